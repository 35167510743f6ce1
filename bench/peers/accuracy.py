"""The accuracy figures every attention row of the peers benchmark reports,
against a float64 reference (latent: relative Frobenius; lse: max abs)."""

from __future__ import annotations

import torch


def latent_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x.double() - ref) / torch.linalg.vector_norm(ref))


def lse_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).abs().max())


def check_baseline(row: dict, p_latent, p_lse, ref_latent, ref_lse, ours) -> tuple[float, float]:
    """row["check_baseline"]: the peer against the reference; where ours ran,
    row["check_ours_vs_baseline"]: ours against the peer. Returns the peer's errors."""
    e_lat, e_lse = latent_error(p_latent, ref_latent), lse_error(p_lse, ref_lse)
    row["check_baseline"] = {"latent_rel": e_lat, "lse_abs": e_lse}
    if ours and "latent" in ours:
        row["check_ours_vs_baseline"] = {
            "latent_rel": latent_error(ours["latent"], p_latent.double()),
            "lse_abs": lse_error(ours["lse"], p_lse),
        }
    return e_lat, e_lse
