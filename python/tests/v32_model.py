"""float64 / CPU models of DeepSeek-V3.2's 656-byte FP8 cache and its
attention, shared by the GPU tests (imported after they found PyTorch)."""

import math

import torch

FP8 = torch.float8_e4m3fn
ENTRY, LATENT, ROPE, GROUP = 656, 512, 64, 128


def v32_entry_model(kv_c, k_pe):
    """vLLM's concat_and_cache_ds_mla bytes [m, 656] on the CPU, in IEEE float32:
    scale = max(amax / 448, FLT_MIN) per 128 values, code = e4m3(x / scale) RNE
    (saturating), then the BF16 RoPE values verbatim (finite inputs)."""
    x = kv_c.float().cpu().view(-1, 4, GROUP)
    amax = x.abs().amax(dim=2)
    scale = torch.clamp(amax / torch.tensor(448.0), min=torch.finfo(torch.float32).tiny)
    codes = (x / scale[..., None]).clamp(-448, 448).to(FP8).view(torch.uint8).view(-1, LATENT)
    out = torch.empty((kv_c.shape[0], ENTRY), dtype=torch.uint8)
    out[:, :LATENT] = codes
    out[:, 512:528] = scale.contiguous().view(torch.uint8).view(-1, 16)
    out[:, 528:] = k_pe.cpu().contiguous().view(torch.uint8).view(-1, 128)
    return out


def dequantized(cache_bytes):
    """[..., 656] bytes -> [slots, 576] float64 keys (code x its group's scale | RoPE)."""
    flat = cache_bytes.reshape(-1, ENTRY)
    codes = flat[:, :LATENT].contiguous().view(FP8).double().view(-1, 4, GROUP)
    scales = flat[:, 512:528].contiguous().view(torch.float32).double()
    rope = flat[:, 528:].contiguous().view(torch.bfloat16).double()
    return torch.cat([(codes * scales[..., None]).view(-1, LATENT), rope], dim=1)


def attention_float64(q, cache, indices, scale):
    """float64 latent [m, H, 512] and lse [m, H] over the dequantized cache; negative indices are none."""
    keys = dequantized(cache)  # [slots, 576]
    m = q.shape[0]
    latent = torch.zeros((m, q.shape[1], LATENT), dtype=torch.float64, device=q.device)
    lse = torch.full((m, q.shape[1]), -math.inf, dtype=torch.float64, device=q.device)
    for t in range(m):
        valid = indices[t][(indices[t] >= 0) & (indices[t] < keys.shape[0])].long()
        if valid.numel() == 0:
            continue
        k = keys[valid]
        s = q[t].double() @ k.T * scale
        lse[t] = torch.logsumexp(s, dim=1)
        latent[t] = torch.softmax(s, dim=1) @ k[:, :LATENT]
    return latent, lse
