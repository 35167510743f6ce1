// A layer's attention weights read from a Hugging Face checkpoint
// (safetensors files), for dsa-decode --weights.
//
// The safetensors format: an 8-byte little-endian header length N, N bytes of
// JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, optional
// "__metadata__": {string: string}}, then the tensors' raw little-endian
// bytes, offsets relative to the end of the header. Read here directly (a
// small JSON parser for the header; no dependency).
//
// Names and layouts (as vLLM's DeepSeek-V3.2 / GLM-5 models load them; see
// load_layer_weights): the fused qkv_a projection is [q_a_proj;
// kv_a_proj_with_mqa] (vLLM's fused_qkv_a_proj), kv_b_proj [H * (P + V), L]
// splits per head into W_UK_T [H, P, L] and W_UV [H, L, V] as vLLM's MLA
// process_weights_after_loading does (kv_b_proj.weight.T viewed [L, H, P + V],
// split at P, permuted), and --tp's rank 0 keeps the first heads of the
// column-parallel q_b_proj and kv_b_proj and the first input columns of the
// row-parallel o_proj; everything else is replicated.
//
// Dtypes: BF16 (kept), F32 (rounded to BF16, nearest even, where the stage
// takes BF16) and F8_E4M3 with 128 x 128 block scales (the tensor's name +
// "_scale_inv": `weight_scale_inv` beside `weight`, F32 [ceil(rows / 128),
// ceil(cols / 128)], as DeepSeek-V3.2's checkpoint stores them), dequantized
// at load: bf16_rne(e4m3 * scale_inv of its block), the value vLLM's block
// dequantization gives.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dsa_decode/status.h"
#include "synthetic_layer.h"

namespace dsa::cli {

// One tensor of a safetensors file, as its header describes it.
struct SafeTensor {
  std::string name;
  std::string dtype;            // as the header spells it: "BF16", "F32", "F8_E4M3", ...
  std::vector<int64_t> shape;
  std::string file;             // the file that holds it
  uint64_t offset = 0;          // of its first byte in `file`
  uint64_t bytes = 0;

  int64_t elements() const;
  std::string shape_text() const;  // "[4096, 1536]"
};

// The bytes of one element of a safetensors dtype; 0 for a name it does not know.
int safetensors_dtype_size(const std::string& dtype);

// The tensors of a checkpoint: one directory (its model.safetensors.index.json
// when present, else every *.safetensors file in it) or a list of
// .safetensors files.
class Checkpoint {
 public:
  // `paths`: one directory, or files. With an index, only the files that
  // hold a tensor of `wanted` are opened (empty: all of them). Every header is
  // checked whole: a bad header, a tensor whose bytes do not match its dtype
  // and shape, or whose data runs past the end of its file (a truncated file),
  // is an error naming the file and the tensor.
  static Status open(const std::vector<std::string>& paths, const std::vector<std::string>& wanted, Checkpoint* out);

  const SafeTensor* find(const std::string& name) const;  // nullptr: not in the checkpoint
  // Reads the bytes [first, first + count) of `tensor`'s data into `into`.
  Status read(const SafeTensor& tensor, uint64_t first, uint64_t count, void* into) const;
  // Reads the first `row_bytes` of each of the tensor's first `rows` rows of
  // `stride` bytes (a column prefix of a row-major matrix), packed, into `into`.
  Status read_rows(const SafeTensor& tensor, uint64_t rows, uint64_t stride, uint64_t row_bytes, void* into) const;

  // Whether the index (model.safetensors.index.json) names the tensor.
  bool indexes(const std::string& name) const { return indexed_.count(name) > 0; }
  size_t file_count() const { return files_.size(); }
  size_t tensor_count() const { return tensors_.size(); }
  uint64_t bytes_read() const { return bytes_read_; }
  // config.json beside the files (a directory's), "" when there is none.
  const std::string& config_json() const { return config_json_; }

 private:
  Status add_file(const std::string& path);

  std::map<std::string, SafeTensor> tensors_;
  std::vector<std::string> files_;
  std::set<std::string> indexed_;  // every name of the index's weight_map
  std::string config_json_;
  mutable uint64_t bytes_read_ = 0;
};

// `--weights`' value: paths separated by commas.
std::vector<std::string> split_weight_paths(const std::string& weights);

// The Hugging Face name of the layer's tensor `suffix`, e.g.
// "model.layers.3.self_attn.q_b_proj.weight" for (3, "q_b_proj.weight").
std::string layer_tensor_name(int layer, const std::string& suffix);

// What load_layer_weights read and how fast.
struct CheckpointLoad {
  size_t files = 0;           // files opened
  size_t tensors = 0;         // of the layer, read
  size_t fp8_tensors = 0;     // of those, dequantized from FP8 blocks
  uint64_t bytes = 0;         // read from the files
  double seconds = 0;         // opening and reading, dequantization and splitting included
  std::string eps_source;     // where the norms' epsilon came from
  double gb_per_s() const { return seconds > 0 ? double(bytes) / seconds * 1e-9 : 0; }
};

// Rank 0's weights of layer `layer` at `shape` (the preset's shapes on one of
// shape.tp ranks; the checkpoint holds the whole model's heads, H * tp) from
// the checkpoint at `paths`, in the form make_weights gives them. q_scale and
// k_scale are the synthetic layer's calibrated static scales (a Hugging Face
// checkpoint holds no activation scales for them); eps is config.json's
// rms_norm_eps where a config.json is beside the files, else the synthetic
// layer's. Every missing tensor, wrong shape, unsupported dtype and missing
// or mis-shaped block scale is named in one error.
Status load_layer_weights(const std::vector<std::string>& paths, int layer, const StepShape& shape, HostWeights* out,
                          CheckpointLoad* load);

// The layer dsa-decode runs: the checkpoint's layer `layer` when `weights`
// (--weights) is not empty, else the synthetic layer of `seed`; `what` says
// which, where from and (a checkpoint) how fast it loaded, for the printout.
Status build_layer_weights(const StepShape& shape, const std::string& weights, int layer, uint64_t seed,
                           HostWeights* out, std::string* what);

// ---- A Hugging Face config.json's shapes (dsa-decode --config) ----

// The fields dsa-decode reads, under their Hugging Face names. The indexer's
// four are required; the others, where present, replace the preset's.
struct ModelConfig {
  std::string path;  // where it was read from ("" for text)
  int index_n_heads = 0;   // the indexer's heads: 16, 32 or 64
  int index_kpool = 0;     // tokens per pool: 4, 8 or 16
  int index_topk = 0;      // tokens of the selected pools: a multiple of index_kpool, at most 512 pools
  int index_head_dim = 0;  // 128
  // Present (positive integers) or absent.
  std::optional<int> hidden_size, num_attention_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim,
      qk_rope_head_dim, v_head_dim;
};

// Reads the fields from config.json text (the top-level object; where it has
// no index_n_heads but a "text_config" object, that object). One error names
// every field that is missing (the indexer's four), mistyped (not an
// integer) or unsupported (index_n_heads not 16, 32 or
// 64; index_kpool not 4, 8 or 16; index_topk not a multiple of index_kpool
// or past 512 pools; index_head_dim not 128; kv_lora_rank not 512;
// qk_rope_head_dim not 0; a size not positive; hidden_size or q_lora_rank not a
// multiple of 8), with what each must be and what it is. `where` names the
// file in the message.
Status parse_model_config(const std::string& text, const std::string& where, ModelConfig* out);
// The same from a file, or a directory holding config.json.
Status read_model_config(const std::string& path, ModelConfig* out);

// The preset (whole model, tp 1) with the config's fields: its indexer
// shape (with_indexer_shape) and each present size; softmax_scale becomes
// (qk_nope_head_dim + qk_rope_head_dim)^-0.5 when either is present.
Status apply_model_config(const ModelPreset& preset, const ModelConfig& config, ModelPreset* out);

// ---- Writing checkpoints (the tests' and the test fixtures' small layers) ----

struct TensorToWrite {
  std::string name;
  std::string dtype;           // "BF16", "F32", "F8_E4M3"
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;   // little-endian, row-major
};

// One safetensors file holding `tensors` in the given order.
Status write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors);
// model.safetensors.index.json in `directory`: {"metadata": {}, "weight_map": {name: file}}.
Status write_safetensors_index(const std::string& directory, const std::map<std::string, std::string>& weight_map);

enum class CheckpointDType {
  kBF16,      // every tensor BF16
  kFp8Block,  // the 2-D projections F8_E4M3 with F32 128 x 128 block scales (_scale_inv), the rest BF16
};

// The layer's tensors by their Hugging Face names, made from the weights of a
// whole-model shape (`whole.tp` == 1): the inverse of load_layer_weights at
// TP1. In FP8, each 128 x 128 block's scale_inv is its amax / 448 (1 for an
// all-zero block) and its codes e4m3(value / scale_inv), saturating RNE.
std::vector<TensorToWrite> layer_tensors(const StepShape& whole, const HostWeights& weights, int layer,
                                         CheckpointDType dtype);

// The BF16 values an FP8 block-scaled tensor [rows, cols] dequantizes to.
std::vector<uint16_t> dequantize_fp8_blocks(const uint8_t* codes, const float* scale_inv, int64_t rows, int64_t cols);

}  // namespace dsa::cli
