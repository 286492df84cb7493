#include "decoder_cpu.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "attention_cpu.h"
#include "cpu_vec.h"
#include "layer_ops_cpu.h"
#include "linear_cpu.h"

namespace flexinfer {
namespace {

std::int64_t ElementBytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// The pass's intermediate tensors, each [tokens, width] and dense, in one
// allocation (each start 64-byte aligned).
struct Scratch {
  void* x;         // a norm's output, [hidden]
  void* qkv;       // [(heads + 2 kv_heads) head_dim]
  void* attended;  // [heads head_dim]
  void* mid;       // the residual stream after attention, [hidden]
  void* gate_up;   // [2 inter]
  void* act;       // [inter]
  std::unique_ptr<float[]> storage;
};

Scratch Allocate(const DecoderArgs& a, std::int64_t qkv_width, std::int64_t q_width) {
  const std::int64_t element = ElementBytes(a.dtype);
  const std::int64_t widths[] = {a.hidden_size, qkv_width, q_width, a.hidden_size, 2 * a.intermediate_size,
                                 a.intermediate_size};
  std::int64_t offsets[6], bytes = 0;
  for (int i = 0; i < 6; ++i) {
    offsets[i] = bytes;
    bytes += (a.tokens * widths[i] * element + 63) / 64 * 64;
  }
  Scratch s;
  s.storage.reset(new float[bytes / 4 + 16]);  // std::bad_alloc when out of memory
  char* base = reinterpret_cast<char*>(s.storage.get());
  base += (64 - reinterpret_cast<std::uintptr_t>(base) % 64) % 64;
  void** fields[] = {&s.x, &s.qkv, &s.attended, &s.mid, &s.gate_up, &s.act};
  for (int i = 0; i < 6; ++i) *fields[i] = base + offsets[i];
  return s;
}

RmsNormArgs Norm(const DecoderArgs& a, const void* x, const void* weight, void* out) {
  RmsNormArgs n;
  n.x = x;
  n.x_stride = a.hidden_size;
  n.weight = weight;
  n.out = out;
  n.out_stride = a.hidden_size;
  n.rows = a.tokens;
  n.dim = a.hidden_size;
  n.eps = a.eps;
  n.dtype = a.dtype;
  n.threads = a.threads;
  return n;
}

LinearArgs Projection(const DecoderArgs& a, const void* x, std::int64_t k, const void* packed, const void* bias,
                      const void* residual, void* y, std::int64_t n) {
  LinearArgs l;
  l.x = x;
  l.x_stride = k;
  l.packed = packed;
  l.bias = bias;
  l.residual = residual;
  l.residual_stride = n;
  l.y = y;
  l.y_stride = n;
  l.m = a.tokens;
  l.n = n;
  l.k = k;
  l.dtype = a.dtype;
  l.threads = a.threads;
  return l;
}

// One layer's calls, built before any runs so that all are checked first.
struct LayerCalls {
  RmsNormArgs input_norm;
  LinearArgs qkv;
  RotaryKVWriteArgs rotary;
  AttentionArgs attention;
  LinearArgs o;
  RmsNormArgs post_norm;
  LinearArgs gate_up;
  SiluMulArgs silu_mul;
  LinearArgs down;
};

LayerCalls Calls(const DecoderArgs& a, std::int64_t l, const Scratch& s) {
  const DecoderLayerWeights& w = a.weights[l];
  const std::int64_t hd = a.head_dim, q_width = a.heads * hd, qkv_width = (a.heads + 2 * a.kv_heads) * hd;
  const std::int64_t inter = a.intermediate_size;
  const DecoderLayerCache& cache = a.cache[l];
  LayerCalls c;
  c.input_norm = Norm(a, a.hidden, w.input_norm, s.x);
  c.qkv = Projection(a, s.x, a.hidden_size, w.qkv, w.qkv_bias, nullptr, s.qkv, qkv_width);

  RotaryKVWriteArgs& r = c.rotary;
  r.qkv = s.qkv;
  r.qkv_stride_token = qkv_width;
  r.qkv_stride_head = hd;
  r.cos = a.cos;
  r.sin = a.sin;
  r.cos_stride = r.sin_stride = hd;
  r.kv = cache.kv;
  r.kv_stride_slot = cache.stride_slot;
  r.kv_stride_token = cache.stride_token;
  r.kv_stride_kv = cache.stride_kv;
  r.kv_stride_head = cache.stride_head;
  r.max_slots = a.max_slots;
  r.max_tokens = a.max_tokens;
  r.slots = a.slot_index[cache.group];
  r.positions = a.positions;
  r.tokens = a.tokens;
  r.heads = a.heads;
  r.kv_heads = a.kv_heads;
  r.head_dim = a.head_dim;
  r.dtype = a.dtype;
  r.threads = a.threads;

  AttentionArgs& t = c.attention;
  t.q = s.qkv;
  t.q_stride_token = qkv_width;
  t.q_stride_head = hd;
  t.out = s.attended;
  t.out_stride_token = q_width;
  t.out_stride_head = hd;
  t.k = cache.kv;
  t.v = static_cast<const char*>(cache.kv) + cache.stride_kv * ElementBytes(a.dtype);
  t.kv_stride_slot = cache.stride_slot;
  t.kv_stride_token = cache.stride_token;
  t.kv_stride_head = cache.stride_head;
  t.max_slots = a.max_slots;
  t.max_tokens = a.max_tokens;
  t.slots = a.slots[cache.group];
  t.seq_lens = a.seq_lens;
  t.cu_q = a.cu_q;
  t.batch = a.batch;
  t.num_queries = a.tokens;
  t.heads = a.heads;
  t.kv_heads = a.kv_heads;
  t.head_dim = a.head_dim;
  t.dtype = a.dtype;
  t.scale = a.scale;
  t.threads = a.threads;

  c.o = Projection(a, s.attended, q_width, w.o, nullptr, a.hidden, s.mid, a.hidden_size);
  c.post_norm = Norm(a, s.mid, w.post_norm, s.x);
  c.gate_up = Projection(a, s.x, a.hidden_size, w.gate_up, nullptr, nullptr, s.gate_up, 2 * inter);

  SiluMulArgs& m = c.silu_mul;
  m.gate_up = s.gate_up;
  m.gate_up_stride = 2 * inter;
  m.out = s.act;
  m.out_stride = inter;
  m.rows = a.tokens;
  m.inter = inter;
  m.dtype = a.dtype;
  m.threads = a.threads;

  // The down projection adds the attention's residual (mid, which o wrote
  // from `hidden` and its own output) and writes the stream back into
  // `hidden`: no call's output is one of its inputs.
  c.down = Projection(a, s.act, inter, w.down, nullptr, s.mid, a.hidden, a.hidden_size);
  return c;
}

void CheckShapes(const DecoderArgs& a) {
  if (a.dtype != DType::kFloat32 && a.dtype != DType::kBFloat16) Invalid("the decoder takes float32 or bfloat16");
  if (a.layers < 0 || a.tokens < 0 || a.batch < 0) Invalid("negative layer, token or request count");
  if (a.hidden_size <= 0 || a.intermediate_size <= 0) Invalid("hidden and intermediate sizes must be positive");
  // What the kernels would otherwise check only at their first call, and the
  // scratch size needs before that.
  if (a.heads <= 0 || a.kv_heads <= 0 || a.head_dim <= 0) Invalid("head counts and head_dim must be positive");
  if (!(a.eps >= 0.0f) || std::isinf(a.eps)) Invalid("the norms' eps must be finite and >= 0");
  if (a.groups < 1) Invalid("the cache needs at least one layer group");
  if (a.layers == 0 || a.tokens == 0) return;
  if (a.positions == nullptr || a.slot_index == nullptr || a.slots == nullptr || a.seq_lens == nullptr ||
      a.weights == nullptr || a.cache == nullptr)
    Invalid("a null decoder argument");
  for (std::int64_t g = 0; g < a.groups; ++g) {
    if (a.slot_index[g] == nullptr || a.slots[g] == nullptr) Invalid("null slots of layer group " + std::to_string(g));
  }
  for (std::int64_t l = 0; l < a.layers; ++l) {
    const DecoderLayerWeights& w = a.weights[l];
    const DecoderLayerCache& c = a.cache[l];
    if (!w.input_norm || !w.qkv || !w.o || !w.post_norm || !w.gate_up || !w.down || !c.kv)
      Invalid("layer " + std::to_string(l) + " has a null weight or cache view");
    if (c.group < 0 || c.group >= a.groups)
      Invalid("layer " + std::to_string(l) + " is in group " + std::to_string(c.group) + " of " +
              std::to_string(a.groups));
  }
}

// The layers of one pass, every call built and checked before any runs.
struct LayerPlan {
  Scratch scratch;
  std::vector<LayerCalls> calls;
};

LayerPlan Plan(const DecoderArgs& a) {
  CheckShapes(a);
  LayerPlan plan;
  if (a.layers == 0 || a.tokens == 0) return plan;
  const std::int64_t q_width = std::int64_t{a.heads} * a.head_dim;
  plan.scratch = Allocate(a, (std::int64_t{a.heads} + 2 * a.kv_heads) * a.head_dim, q_width);
  plan.calls.reserve(a.layers);
  for (std::int64_t l = 0; l < a.layers; ++l) {
    plan.calls.push_back(Calls(a, l, plan.scratch));
    CheckRotaryKVWrite(plan.calls.back().rotary);
    CheckAttention(plan.calls.back().attention);
  }
  return plan;
}

void Run(const LayerPlan& plan) {
  for (const LayerCalls& c : plan.calls) {
    RmsNorm(c.input_norm);
    PackedLinear(c.qkv);
    RotaryKVWrite(c.rotary);
    Attention(c.attention);
    PackedLinear(c.o);
    RmsNorm(c.post_norm);
    PackedLinear(c.gate_up);
    SiluMul(c.silu_mul);
    PackedLinear(c.down);
  }
}

void CheckEnds(const DecoderArgs& a, const DecoderEnds& e) {
  if (a.batch > 0 && a.tokens == 0) Invalid("requests without tokens have no last token");
  if (a.tokens == 0) return;
  if (e.input_ids == nullptr || e.embed == nullptr || e.cos_table == nullptr || e.sin_table == nullptr ||
      e.final_norm == nullptr || e.lm_head == nullptr || e.last_index == nullptr || e.logits == nullptr ||
      a.positions == nullptr)
    Invalid("a null argument of the pass's ends");
  if (e.vocab <= 0 || e.lm_vocab <= 0 || e.table_positions <= 0)
    Invalid("the vocabularies and the RoPE tables must not be empty");
  for (std::int64_t t = 0; t < a.tokens; ++t) {
    if (e.input_ids[t] < 0 || e.input_ids[t] >= e.vocab)
      Invalid("token id " + std::to_string(e.input_ids[t]) + " is outside [0, " + std::to_string(e.vocab) + ")");
    if (a.positions[t] < 0 || a.positions[t] >= e.table_positions)
      Invalid("position " + std::to_string(a.positions[t]) + " is outside the RoPE tables' [0, " +
              std::to_string(e.table_positions) + ")");
  }
  for (std::int64_t r = 0; r < a.batch; ++r) {
    if (e.last_index[r] < 0 || e.last_index[r] >= a.tokens)
      Invalid("request " + std::to_string(r) + "'s last token " + std::to_string(e.last_index[r]) +
              " is outside [0, " + std::to_string(a.tokens) + ")");
  }
}

// Copies rows[index[i]] of a dense [*, width] table into out's row i.
void GatherRows(const void* rows, const std::int64_t* index, std::int64_t count, std::int64_t row_bytes,
                void* out) {
  for (std::int64_t i = 0; i < count; ++i)
    std::memcpy(static_cast<char*>(out) + i * row_bytes, static_cast<const char*>(rows) + index[i] * row_bytes,
                row_bytes);
}

}  // namespace

void DecoderLayers(const DecoderArgs& a) {
  if (a.layers > 0 && a.tokens > 0 && (a.hidden == nullptr || a.cos == nullptr || a.sin == nullptr))
    Invalid("a null hidden state, cos or sin");
  Run(Plan(a));
}

void DecoderForward(const DecoderArgs& args, const DecoderEnds& e) {
  CheckShapes(args);  // what the scratch's size needs; Plan checks the rest
  CheckEnds(args, e);
  if (args.tokens == 0) return;
  const std::int64_t element = ElementBytes(args.dtype), hidden_bytes = args.hidden_size * element;
  const std::int64_t rope_bytes = std::int64_t{args.head_dim} * element;
  // The pass's own tensors: hidden, cos and sin per token; per request its
  // last row, that row normed and, in bfloat16, the head's output before
  // it is widened.
  const std::int64_t head_out = args.dtype == DType::kFloat32 ? 0 : args.batch * e.lm_vocab;
  const std::int64_t widths[] = {args.tokens * args.hidden_size, args.tokens * args.head_dim,
                                 args.tokens * args.head_dim, args.batch * args.hidden_size,
                                 args.batch * args.hidden_size, head_out};
  std::int64_t offsets[6], bytes = 0;
  for (int i = 0; i < 6; ++i) {
    offsets[i] = bytes;
    bytes += (widths[i] * element + 63) / 64 * 64;
  }
  std::unique_ptr<float[]> storage(new float[bytes / 4 + 16]);  // std::bad_alloc before anything is written
  char* base = reinterpret_cast<char*>(storage.get());
  base += (64 - reinterpret_cast<std::uintptr_t>(base) % 64) % 64;
  void* buffers[6];
  for (int i = 0; i < 6; ++i) buffers[i] = base + offsets[i];
  void *hidden = buffers[0], *cos = buffers[1], *sin = buffers[2], *last = buffers[3], *normed = buffers[4];

  DecoderArgs a = args;
  a.hidden = hidden;
  a.cos = cos;
  a.sin = sin;
  const LayerPlan plan = Plan(a);
  RmsNormArgs norm = Norm(a, last, e.final_norm, normed);
  norm.rows = a.batch;
  LinearArgs head = Projection(a, normed, a.hidden_size, e.lm_head, nullptr, nullptr,
                               head_out ? buffers[5] : static_cast<void*>(e.logits), e.lm_vocab);
  head.m = a.batch;

  GatherRows(e.embed, e.input_ids, a.tokens, hidden_bytes, hidden);
  GatherRows(e.cos_table, a.positions, a.tokens, rope_bytes, cos);
  GatherRows(e.sin_table, a.positions, a.tokens, rope_bytes, sin);
  Run(plan);
  if (a.batch == 0) return;
  GatherRows(hidden, e.last_index, a.batch, hidden_bytes, last);
  RmsNorm(norm);
  PackedLinear(head);
  if (head_out) {
    const auto* narrow = static_cast<const std::uint16_t*>(buffers[5]);
    for (std::int64_t i = 0; i < head_out; ++i) e.logits[i] = Widen(narrow[i]);
  }
}

}  // namespace flexinfer
