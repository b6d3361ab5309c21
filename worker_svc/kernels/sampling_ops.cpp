// Structured outputs on a CPU rank: the engine core's packed token bitmask applied to logits
// rows in place (vLLM's apply_grammar_bitmask; xgrammar's apply_token_bitmask_inplace_cpu):
// every token whose bit is 0 gets logit -inf. One bit is read per token and only the refused
// logits are written: a word whose 32 tokens are all allowed costs one load (inside a JSON
// string nearly all are), a word refusing all 32 is one vectorised store of -inf (between keys
// nearly all are), and the logits are never read.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

namespace {

using at::Tensor;

void check_rows(const Tensor& rows, int64_t n, int64_t limit, const char* what) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() &&
                  rows.numel() == n,
              what, " must be a contiguous int64 vector, one entry per pair");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k)
    TORCH_CHECK(r[k] >= 0 && r[k] < limit, what, "[", k, "] = ", r[k], " is out of range");
}

inline void refuse_word(float* tokens, uint32_t allowed) {
  constexpr float refused = -std::numeric_limits<float>::infinity();
  if (allowed == 0u) {
    for (int b = 0; b < 32; ++b) tokens[b] = refused;
    return;
  }
  for (uint32_t left = ~allowed; left != 0u; left &= left - 1u) tokens[__builtin_ctz(left)] = refused;
}

void refuse_row(float* row, const uint32_t* mask, int64_t vocab) {
  const int64_t full_words = vocab / 32, tail = vocab % 32;
  for (int64_t w = 0; w < full_words; ++w)
    if (mask[w] != 0xffffffffu) refuse_word(row + 32 * w, mask[w]);
  if (tail) {  // the bits past the vocabulary count as allowed: nothing is written there
    const uint32_t allowed = mask[full_words] | ~((1u << tail) - 1u);
    if (allowed != 0xffffffffu) {
      for (uint32_t left = ~allowed; left != 0u; left &= left - 1u)
        row[32 * full_words + __builtin_ctz(left)] = -std::numeric_limits<float>::infinity();
    }
  }
}

// logits[logit_rows[k]] takes the mask bitmask[mask_rows[k]], for every k.
void apply_token_bitmask_(const Tensor& logits, const Tensor& bitmask, const Tensor& logit_rows,
                          const Tensor& mask_rows) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be float32 [N, V] with contiguous rows");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "bitmask must be a contiguous int32 [M, W]");
  const int64_t vocab = logits.size(1), words = bitmask.size(1), n = logit_rows.numel();
  TORCH_CHECK(words == (vocab + 31) / 32, "bitmask rows have ", words, " words; ", vocab,
              " tokens need ", (vocab + 31) / 32);
  check_rows(logit_rows, n, logits.size(0), "logit_rows");
  check_rows(mask_rows, n, bitmask.size(0), "mask_rows");
  float* base = logits.data_ptr<float>();
  const auto* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const int64_t* lr = logit_rows.data_ptr<int64_t>();
  const int64_t* mr = mask_rows.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k) refuse_row(base + lr[k] * logits.stride(0), bits + mr[k] * words, vocab);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask, Tensor logit_rows, Tensor mask_rows) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) { m.impl("apply_token_bitmask_", apply_token_bitmask_); }
