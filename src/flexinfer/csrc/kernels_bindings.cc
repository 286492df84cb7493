// Python binding of FlexInfer's CPU kernels (module flexinfer._kernels).
//
// Tensors cross as raw pointers and strides: the Python wrapper
// (src/flexinfer/kernels/cpu_attention.py) checks dtypes, shapes and devices and
// passes torch's data pointers, so this module needs no torch headers. The GIL
// is released while a kernel runs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "attention_cpu.h"
#include "cpu_vec.h"
#include "decoder_cpu.h"
#include "layer_ops_cpu.h"
#include "linear_cpu.h"
#include "sampling_cpu.h"

namespace py = pybind11;

namespace flexinfer {
namespace {

const void* Ptr(std::uintptr_t address) { return reinterpret_cast<const void*>(address); }

DType ToDType(int code) {
  if (code < 0 || code > 2) throw std::invalid_argument("unknown dtype code");
  return static_cast<DType>(code);
}

// A model's decoder as a pass calls it (decoder_cpu.h): what belongs to the
// model (shapes, the layers' weight addresses, the pass's ends) is
// converted once, at construction, so that a call converts only its own
// arguments. The Python side (src/flexinfer/kernels/cpu_decoder.py) keeps the
// tensors behind every address alive and checks what it passes.
class Decoder {
 public:
  // weight_table: an int64 array [layers][7] of weight addresses in
  // DecoderLayerWeights' order.
  Decoder(std::int64_t layers, std::int64_t hidden_size, std::int64_t intermediate_size, int heads, int kv_heads,
          int head_dim, float eps, float scale, int dtype, std::uintptr_t weight_table, std::uintptr_t embed,
          std::int64_t vocab, std::uintptr_t cos_table, std::uintptr_t sin_table, std::int64_t table_positions,
          std::uintptr_t final_norm, std::uintptr_t lm_head, std::int64_t lm_vocab) {
    if (layers < 0) throw std::invalid_argument("negative layer count");
    const auto* w = static_cast<const std::int64_t*>(Ptr(weight_table));
    weights_.resize(layers);
    for (std::int64_t l = 0; l < layers; ++l) {
      const std::int64_t* row = w + 7 * l;
      weights_[l] = {Ptr(row[0]), Ptr(row[1]), Ptr(row[2]), Ptr(row[3]), Ptr(row[4]), Ptr(row[5]), Ptr(row[6])};
    }
    args_.layers = layers;
    args_.hidden_size = hidden_size;
    args_.intermediate_size = intermediate_size;
    args_.heads = heads;
    args_.kv_heads = kv_heads;
    args_.head_dim = head_dim;
    args_.eps = eps;
    args_.scale = scale;
    args_.dtype = ToDType(dtype);
    args_.weights = weights_.data();
    ends_.embed = Ptr(embed);
    ends_.vocab = vocab;
    ends_.cos_table = Ptr(cos_table);
    ends_.sin_table = Ptr(sin_table);
    ends_.table_positions = table_positions;
    ends_.final_norm = Ptr(final_norm);
    ends_.lm_head = Ptr(lm_head);
    ends_.lm_vocab = lm_vocab;
  }

  // args_ points into weights_: a copy would point into the original's.
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  // Every layer over hidden [tokens, hidden_size] in place (DecoderLayers).
  void Layers(std::uintptr_t cache_table, std::int64_t groups, std::int64_t max_slots, std::int64_t max_tokens,
              std::int64_t tokens, std::int64_t batch, std::uintptr_t hidden, std::uintptr_t cos, std::uintptr_t sin,
              std::uintptr_t positions, const std::vector<std::uintptr_t>& slot_index,
              const std::vector<std::uintptr_t>& slots, std::uintptr_t seq_lens, std::uintptr_t cu_q, int threads) {
    Pass pass(*this, cache_table, groups, max_slots, max_tokens, tokens, batch, positions, slot_index, slots,
              seq_lens, cu_q, threads);
    pass.args.hidden = reinterpret_cast<void*>(hidden);
    pass.args.cos = Ptr(cos);
    pass.args.sin = Ptr(sin);
    py::gil_scoped_release release;
    DecoderLayers(pass.args);
  }

  // The whole pass, input ids in, float32 logits [batch, lm_vocab] of each
  // request's last token out (DecoderForward).
  void Forward(std::uintptr_t cache_table, std::int64_t groups, std::int64_t max_slots, std::int64_t max_tokens,
               std::int64_t tokens, std::int64_t batch, std::uintptr_t input_ids, std::uintptr_t positions,
               const std::vector<std::uintptr_t>& slot_index, const std::vector<std::uintptr_t>& slots,
               std::uintptr_t seq_lens, std::uintptr_t cu_q, std::uintptr_t last_index, std::uintptr_t logits,
               int threads) {
    Pass pass(*this, cache_table, groups, max_slots, max_tokens, tokens, batch, positions, slot_index, slots,
              seq_lens, cu_q, threads);
    DecoderEnds ends = ends_;
    ends.input_ids = static_cast<const std::int64_t*>(Ptr(input_ids));
    ends.last_index = static_cast<const std::int64_t*>(Ptr(last_index));
    ends.logits = reinterpret_cast<float*>(logits);
    py::gil_scoped_release release;
    DecoderForward(pass.args, ends);
  }

 private:
  // One call's arguments: the model's, with the cache's and the pass's added.
  struct Pass {
    Pass(const Decoder& d, std::uintptr_t cache_table, std::int64_t groups, std::int64_t max_slots,
         std::int64_t max_tokens, std::int64_t tokens, std::int64_t batch, std::uintptr_t positions,
         const std::vector<std::uintptr_t>& slot_index, const std::vector<std::uintptr_t>& slots,
         std::uintptr_t seq_lens, std::uintptr_t cu_q, int threads)
        : args(d.args_) {
      // cache_table: an int64 array [layers][6] of cache views (address, four
      // strides, group: DecoderLayerCache's order); the per-group vectors'
      // addresses come as lists.
      if (groups < 1) throw std::invalid_argument("no layer group");
      if (slot_index.size() != static_cast<std::size_t>(groups) || slots.size() != static_cast<std::size_t>(groups))
        throw std::invalid_argument("one slot index and one slot vector per layer group");
      const auto* cache = static_cast<const std::int64_t*>(Ptr(cache_table));
      views.resize(args.layers);
      for (std::int64_t l = 0; l < args.layers; ++l) {
        const std::int64_t* c = cache + 6 * l;
        views[l] = {reinterpret_cast<void*>(c[0]), c[1], c[2], c[3], c[4], c[5]};
      }
      for (std::int64_t g = 0; g < groups; ++g) {
        group_slot_index.push_back(static_cast<const std::int64_t*>(Ptr(slot_index[g])));
        group_slots.push_back(static_cast<const std::int32_t*>(Ptr(slots[g])));
      }
      args.cache = views.data();
      args.groups = groups;
      args.max_slots = max_slots;
      args.max_tokens = max_tokens;
      args.tokens = tokens;
      args.batch = batch;
      args.positions = static_cast<const std::int64_t*>(Ptr(positions));
      args.slot_index = group_slot_index.data();
      args.slots = group_slots.data();
      args.seq_lens = static_cast<const std::int32_t*>(Ptr(seq_lens));
      args.cu_q = static_cast<const std::int32_t*>(Ptr(cu_q));
      args.threads = threads;
    }
    Pass(const Pass&) = delete;
    Pass& operator=(const Pass&) = delete;

    DecoderArgs args;
    std::vector<DecoderLayerCache> views;
    std::vector<const std::int64_t*> group_slot_index;
    std::vector<const std::int32_t*> group_slots;
  };

  std::vector<DecoderLayerWeights> weights_;
  DecoderArgs args_;  // the model's part; the rest is each call's
  DecoderEnds ends_;  // the model's part: tables, norm and head
};

}  // namespace

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "FlexInfer's CPU kernels; use flexinfer.kernels, which checks the arguments.";
  m.def(
      "attention",
      [](std::uintptr_t q, std::int64_t q_stride_token, std::int64_t q_stride_head, std::uintptr_t out,
         std::int64_t out_stride_token, std::int64_t out_stride_head, std::uintptr_t k, std::uintptr_t v,
         std::int64_t kv_stride_slot, std::int64_t kv_stride_token, std::int64_t kv_stride_head,
         std::int64_t max_slots, std::int64_t max_tokens, std::uintptr_t slots, std::uintptr_t seq_lens,
         std::uintptr_t cu_q, std::int64_t batch, std::int64_t num_queries, int heads, int kv_heads,
         int head_dim, int dtype, float scale, std::int64_t window, float softcap, int threads) {
        AttentionArgs a;
        a.q = Ptr(q);
        a.q_stride_token = q_stride_token;
        a.q_stride_head = q_stride_head;
        a.out = reinterpret_cast<void*>(out);
        a.out_stride_token = out_stride_token;
        a.out_stride_head = out_stride_head;
        a.k = Ptr(k);
        a.v = Ptr(v);
        a.kv_stride_slot = kv_stride_slot;
        a.kv_stride_token = kv_stride_token;
        a.kv_stride_head = kv_stride_head;
        a.max_slots = max_slots;
        a.max_tokens = max_tokens;
        a.slots = static_cast<const std::int32_t*>(Ptr(slots));
        a.seq_lens = static_cast<const std::int32_t*>(Ptr(seq_lens));
        a.cu_q = static_cast<const std::int32_t*>(Ptr(cu_q));
        a.batch = batch;
        a.num_queries = num_queries;
        a.heads = heads;
        a.kv_heads = kv_heads;
        a.head_dim = head_dim;
        a.dtype = ToDType(dtype);
        a.scale = scale;
        a.window = window;
        a.softcap = softcap;
        a.threads = threads;
        py::gil_scoped_release release;
        Attention(a);
      },
      "Batched attention over per-layer K/V views (see attention_cpu.h).");
  m.def(
      "packed_linear_size",
      [](std::int64_t n, std::int64_t k, int dtype) { return PackedLinearSize(n, k, ToDType(dtype)); },
      "Elements of a [n, k] weight packed for `linear` (see linear_cpu.h).");
  m.def(
      "pack_linear_weight",
      [](std::uintptr_t w, std::int64_t w_stride, std::int64_t n, std::int64_t k, int dtype, std::uintptr_t packed) {
        const DType type = ToDType(dtype);
        py::gil_scoped_release release;
        PackLinearWeight(Ptr(w), w_stride, n, k, type, reinterpret_cast<void*>(packed));
      },
      "Packs a [n, k] weight into the slab layout of linear_cpu.h.");
  m.def(
      "linear",
      [](std::uintptr_t x, std::int64_t x_stride, std::uintptr_t packed, std::uintptr_t bias,
         std::uintptr_t residual, std::int64_t residual_stride, std::uintptr_t y, std::int64_t y_stride,
         std::int64_t rows, std::int64_t n, std::int64_t k, int dtype, int threads, bool portable) {
        LinearArgs a;
        a.x = Ptr(x);
        a.x_stride = x_stride;
        a.packed = Ptr(packed);
        a.bias = Ptr(bias);
        a.residual = Ptr(residual);
        a.residual_stride = residual_stride;
        a.y = reinterpret_cast<void*>(y);
        a.y_stride = y_stride;
        a.m = rows;
        a.n = n;
        a.k = k;
        a.dtype = ToDType(dtype);
        a.threads = threads;
        a.portable = portable;
        py::gil_scoped_release release;
        PackedLinear(a);
      },
      "y = x @ W.T (+ bias) (+ residual) with W packed (see linear_cpu.h).");
  m.def(
      "greedy_pick",
      [](std::uintptr_t logits, std::int64_t rows, std::int64_t vocab, std::int64_t stride, int threads,
         std::uintptr_t out) {
        py::gil_scoped_release release;
        GreedyPick(static_cast<const float*>(Ptr(logits)), rows, vocab, stride, threads,
                   reinterpret_cast<std::int64_t*>(out));
      },
      "Per row of float32 logits: the index of its first maximum, -1 where the row is not finite.");
  m.def(
      "rms_norm",
      [](std::uintptr_t x, std::int64_t x_stride, std::uintptr_t weight, std::uintptr_t out, std::int64_t out_stride,
         std::int64_t rows, std::int64_t dim, float eps, int dtype, int threads) {
        RmsNormArgs a;
        a.x = Ptr(x);
        a.x_stride = x_stride;
        a.weight = Ptr(weight);
        a.out = reinterpret_cast<void*>(out);
        a.out_stride = out_stride;
        a.rows = rows;
        a.dim = dim;
        a.eps = eps;
        a.dtype = ToDType(dtype);
        a.threads = threads;
        py::gil_scoped_release release;
        RmsNorm(a);
      },
      "out = rms_norm(x) * weight per row (see layer_ops_cpu.h).");
  m.def(
      "silu_mul",
      [](std::uintptr_t gate_up, std::int64_t gate_up_stride, std::uintptr_t out, std::int64_t out_stride,
         std::int64_t rows, std::int64_t inter, int dtype, int threads) {
        SiluMulArgs a;
        a.gate_up = Ptr(gate_up);
        a.gate_up_stride = gate_up_stride;
        a.out = reinterpret_cast<void*>(out);
        a.out_stride = out_stride;
        a.rows = rows;
        a.inter = inter;
        a.dtype = ToDType(dtype);
        a.threads = threads;
        py::gil_scoped_release release;
        SiluMul(a);
      },
      "out = silu(gate) * up per row of [gate | up] (see layer_ops_cpu.h).");
  m.def(
      "rotary_kv_write",
      [](std::uintptr_t qkv, std::int64_t qkv_stride_token, std::int64_t qkv_stride_head, std::uintptr_t cos,
         std::int64_t cos_stride, std::uintptr_t sin, std::int64_t sin_stride, std::uintptr_t kv,
         std::int64_t kv_stride_slot, std::int64_t kv_stride_token, std::int64_t kv_stride_kv,
         std::int64_t kv_stride_head, std::int64_t max_slots, std::int64_t max_tokens, std::uintptr_t slots,
         std::uintptr_t positions, std::int64_t tokens, int heads, int kv_heads, int head_dim, int dtype,
         int threads) {
        RotaryKVWriteArgs a;
        a.qkv = reinterpret_cast<void*>(qkv);
        a.qkv_stride_token = qkv_stride_token;
        a.qkv_stride_head = qkv_stride_head;
        a.cos = Ptr(cos);
        a.cos_stride = cos_stride;
        a.sin = Ptr(sin);
        a.sin_stride = sin_stride;
        a.kv = reinterpret_cast<void*>(kv);
        a.kv_stride_slot = kv_stride_slot;
        a.kv_stride_token = kv_stride_token;
        a.kv_stride_kv = kv_stride_kv;
        a.kv_stride_head = kv_stride_head;
        a.max_slots = max_slots;
        a.max_tokens = max_tokens;
        a.slots = static_cast<const std::int64_t*>(Ptr(slots));
        a.positions = static_cast<const std::int64_t*>(Ptr(positions));
        a.tokens = tokens;
        a.heads = heads;
        a.kv_heads = kv_heads;
        a.head_dim = head_dim;
        a.dtype = ToDType(dtype);
        a.threads = threads;
        py::gil_scoped_release release;
        RotaryKVWrite(a);
      },
      "Rotates q and k of qkv in place and writes k and v into a layer's cache view (see layer_ops_cpu.h).");
  py::class_<Decoder>(m, "Decoder", "A Llama's decoder in one call per pass (see decoder_cpu.h).")
      .def(py::init<std::int64_t, std::int64_t, std::int64_t, int, int, int, float, float, int, std::uintptr_t,
                    std::uintptr_t, std::int64_t, std::uintptr_t, std::uintptr_t, std::int64_t, std::uintptr_t,
                    std::uintptr_t, std::int64_t>())
      .def("layers", &Decoder::Layers, "Every decoder layer of a pass over hidden in place.")
      .def("forward", &Decoder::Forward, "A whole pass: input ids in, each request's float32 logits out.");
  m.def(
      "kernel_arch",
      [] {
#if defined(FLEXINFER_KERNEL_ARCH)
        return std::string(FLEXINFER_KERNEL_ARCH);
#else
        return std::string("clones");
#endif
      },
      "The -march the vector code was built for, or 'clones' (picked per CPU at load; `make test-isa` builds the others).");
  m.def(
      "vector_lanes", [] { return WideVectors() ? 16 : 8; },
      "The float lanes the vector code runs on here: 16 with AVX-512, 8 on other x86-64 CPUs or with "
      "FLEXINFER_KERNEL_LANES=8; 16 in sanitizer builds and on other architectures (cpu_vec.h).");
  m.def("has_amx_bf16", &HasAmxBF16, "Whether bfloat16 linear calls with k % 32 == 0 use AMX tiles.");
  m.def("has_bf16_dot_product", &HasBF16DotProduct,
        "Whether bfloat16 linear calls use the CPU's AVX512-BF16 dot product.");
}

}  // namespace flexinfer
