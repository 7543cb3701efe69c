// kvslim's torch custom ops in C++ (kvslim/kernels/cppops.py builds and loads this file): the compiled paged step's
// products and page attention without Python between torch's dispatcher and the C kernels.
//
//   torch.ops.kvslim_cpp.linear(x, weight, bias) -> Tensor
//   torch.ops.kvslim_cpp.page_attend(q, k, v, handle, layer, scale) -> Tensor
//
// is kvslim.kernels.linear.Prepared's call made in C++: the same checks, the same arguments to the same C function
// (kv_linear, kv_linear_bf16 in kvslim_linear.c), so the same bits; torch's linear where the C function does not take
// the call (another dtype or device, a weight whose rows are not contiguous, autograd recording, or no C function bound
// for the dtype). The C functions' addresses come from the C library as loaded by ctypes (kvslim_ops_bind): this file
// links against torch only, never against the C library.
//
// page_attend is kvslim::page_attend (kvslim/cache/paged_compiled.py) with the layers after a step's first made in
// C++: the Python op lays out the step's four argument tables at its first layer (kvslim/cache/pagecalls.py,
// StepCalls) and hands them here (kvslim_ops_step); each later layer sets the same addresses in them and makes the
// same four C calls (kvp_rotate, kvp_write twice, kvp_attend) as StepCalls.run, so the same bits. Wherever StepCalls.run
// would do anything else (a tensor of another dtype, shape or strides, a staged value past float16's range, a C call
// that declines or fails) the layer goes to the Python op, whole: it redoes the calls (each writes what it wrote
// before) and takes its own fallback or raises its own error.
//
// A step's 211 products called from Inductor's generated C++ (cpp_wrapper) reach the C kernel through the dispatcher
// alone; a Python implementation costs each call a trip into the interpreter (docs/performance.md, "The compiled
// step's ops in C++").

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace {

// kv_linear's argument table (kvslim_linear.c): x, rows, width, x's row stride, weight, outputs, its row stride,
// bias (0: none), y, y's row stride, threads
typedef int (*linear_fn)(const int64_t *);

// [0]: float32, [1]: bfloat16; null: not bound (torch's linear runs)
std::atomic<linear_fn> bound[2] = {nullptr, nullptr};

linear_fn entry(at::ScalarType t) {
  if (t == at::kFloat) return bound[0].load(std::memory_order_relaxed);
  if (t == at::kBFloat16) return bound[1].load(std::memory_order_relaxed);
  return nullptr;
}

at::Tensor linear(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
  const at::ScalarType t = weight.scalar_type();
  linear_fn f = entry(t);
  bool ok = f != nullptr && x.scalar_type() == t && weight.dim() == 2 && x.dim() >= 1 && weight.is_cpu() &&
            x.is_cpu() && weight.layout() == at::kStrided && x.layout() == at::kStrided &&
            !at::GradMode::is_enabled();
  const int64_t o = ok ? weight.size(0) : 0, i = ok ? weight.size(1) : 0;
  ok = ok && i > 0 && (i == 1 || weight.stride(1) == 1) && x.size(-1) == i;
  if (ok && bias.has_value()) {
    const at::Tensor &b = *bias;
    ok = b.scalar_type() == t && b.is_cpu() && b.layout() == at::kStrided && b.dim() == 1 && b.size(0) == o &&
         b.is_contiguous();
  }
  if (!ok) return at::linear(x, weight, bias);
  at::Tensor rows = x.dim() == 2 ? x : x.reshape({-1, i});  // (R, I); I > 0, so -1 is R even at R = 0
  if (rows.stride(1) != 1) rows = rows.contiguous();
  const int64_t r = rows.size(0);
  at::Tensor y = at::empty({r, o}, weight.options());
  if (r > 0 && o > 0) {
    const int64_t args[11] = {
        reinterpret_cast<int64_t>(rows.data_ptr()), r, i, r > 1 ? rows.stride(0) : i,
        reinterpret_cast<int64_t>(weight.data_ptr()), o, o > 1 ? weight.stride(0) : i,
        bias.has_value() ? reinterpret_cast<int64_t>(bias->data_ptr()) : 0,
        reinterpret_cast<int64_t>(y.data_ptr()), o, static_cast<int64_t>(at::get_num_threads()),
    };
    const int rc = f(args);
    TORCH_CHECK(rc == 0, "kvslim's linear kernel refused the call (status ", rc,
                "): a build without its instructions?");
  }
  if (x.dim() == 2) return y;
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = o;
  return y.view(shape);
}

// kvslim_ops_step's fields (kvslim/cache/pagecalls.py, StepCalls.native, lays them out in this order)
enum Field {
  F_ROTATE, F_WRITE, F_STAGE, F_HEAD,  // the tables' addresses (F_STAGE 0: no staging pool)
  F_AMAX,                              // float[2]: the step's largest |key|, |value| (kvp_rotate writes them)
  F_CHECK,                             // 1: a staged value must be under F_LIMIT (float16 staging), 0: no check
  F_LIMIT,                             // that limit, a double's bits
  F_SCALE,                             // the step's scale, a double's bits
  F_LAYERS, F_PAGES, F_STAGED,         // layers; int64[layers] of their pages' (staging pools') addresses
  F_FORMS,                             // q, k, v: 3 sizes and 3 strides each (18 fields)
  F_RK = F_FORMS + 18, F_RV, F_WP, F_HQ, F_HO, F_HP, F_HS,  // where a layer's addresses go in the tables
  F_FN_ROTATE, F_FN_WRITE, F_FN_ATTEND,                     // the C functions
  F_COUNT
};
typedef int (*table_fn)(int64_t *);
typedef std::array<int64_t, F_COUNT> Step;

std::mutex steps_lock;
std::unordered_map<int64_t, Step> steps;  // handle -> its step's fields, while the step runs

double as_double(int64_t bits) {
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

bool fits(const at::Tensor &x, const int64_t *form) {
  if (x.scalar_type() != at::kFloat || !x.is_cpu() || x.layout() != at::kStrided || x.dim() != 3) return false;
  for (int i = 0; i < 3; ++i)
    if (x.size(i) != form[i] || x.stride(i) != form[3 + i]) return false;
  return true;
}

int64_t address(const at::Tensor &x) { return reinterpret_cast<int64_t>(x.data_ptr()); }

// StepCalls.run's four calls for one layer (q, k, v float32: a half model's widened); false (the Python op then
// runs the layer) wherever it would not make them.
bool attend_fast(const Step &s, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t layer,
                 double scale, at::Tensor &out) {
  if (scale != as_double(s[F_SCALE]) || layer < 0 || layer >= s[F_LAYERS] || !fits(q, &s[F_FORMS]) ||
      !fits(k, &s[F_FORMS + 6]) || !fits(v, &s[F_FORMS + 12]))
    return false;
  int64_t *rotate = reinterpret_cast<int64_t *>(s[F_ROTATE]);
  rotate[s[F_RK]] = address(k);
  rotate[s[F_RV]] = address(v);
  if (reinterpret_cast<table_fn>(s[F_FN_ROTATE])(rotate)) return false;
  if (s[F_CHECK]) {
    const float *amax = reinterpret_cast<const float *>(s[F_AMAX]);
    const float km = amax[0], vm = amax[1];
    const double largest = (km != km || km > vm) ? km : vm;
    if (!(largest < as_double(s[F_LIMIT]))) return false;  // (NaN: not <) the Python op names what is out of range
  }
  const table_fn write = reinterpret_cast<table_fn>(s[F_FN_WRITE]);
  const int64_t pages = reinterpret_cast<const int64_t *>(s[F_PAGES])[layer];
  int64_t *table = reinterpret_cast<int64_t *>(s[F_WRITE]);
  table[s[F_WP]] = pages;
  if (write(table)) return false;
  int64_t *head = reinterpret_cast<int64_t *>(s[F_HEAD]);
  if (s[F_STAGE]) {
    const int64_t staged = reinterpret_cast<const int64_t *>(s[F_STAGED])[layer];
    table = reinterpret_cast<int64_t *>(s[F_STAGE]);
    table[s[F_WP]] = staged;
    if (write(table)) return false;
    head[s[F_HS]] = staged;
  }
  out = at::empty(q.sizes(), q.options());
  head[s[F_HQ]] = address(q);
  head[s[F_HO]] = address(out);
  head[s[F_HP]] = pages;
  return reinterpret_cast<table_fn>(s[F_FN_ATTEND])(head) == 0;
}

at::Tensor page_attend(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t handle, int64_t layer,
                       double scale) {
  Step s;
  bool have = false;
  {
    std::lock_guard<std::mutex> hold(steps_lock);
    auto it = steps.find(handle);
    if (it != steps.end()) {
      s = it->second;
      have = true;
    }
  }
  at::Tensor out;
  if (have) {
    const at::ScalarType t = q.scalar_type();
    if ((t == at::kBFloat16 || t == at::kHalf) && k.scalar_type() == t && v.scalar_type() == t) {
      // pagecalls.attend widens a bfloat16 or float16 layer's tensors to float32 (exactly) first: the same here
      if (attend_fast(s, q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), layer, scale, out)) return out;
    } else if (attend_fast(s, q, k, v, layer, scale, out)) {
      return out;
    }
  }
  static const auto python = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("kvslim::page_attend", "")
                                 .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &, int64_t,
                                                   int64_t, double)>();
  return python.call(q, k, v, handle, layer, scale);
}

}  // namespace

extern "C" {

// The fields of the step running under `handle` (F_COUNT of them, read now): its later layers' attention in C++.
int kvslim_ops_step(int64_t handle, const int64_t *fields) {
  Step s;
  std::memcpy(s.data(), fields, sizeof(int64_t) * F_COUNT);
  std::lock_guard<std::mutex> hold(steps_lock);
  steps[handle] = s;
  return F_COUNT;
}

// The step under `handle` has ended: its tables are gone.
void kvslim_ops_end(int64_t handle) {
  std::lock_guard<std::mutex> hold(steps_lock);
  steps.erase(handle);
}

// The version kvslim/kernels/cppops.py expects (a stale build of another version is never bound).
int kvslim_ops_abi(void) { return 2; }

// How many fields kvslim_ops_step reads.
int kvslim_ops_step_fields(void) { return F_COUNT; }

// Bind the C library's products (null: torch's linear for that dtype).
void kvslim_ops_bind(void *f32, void *bf16) {
  bound[0].store(reinterpret_cast<linear_fn>(f32), std::memory_order_relaxed);
  bound[1].store(reinterpret_cast<linear_fn>(bf16), std::memory_order_relaxed);
}

}  // extern "C"

TORCH_LIBRARY(kvslim_cpp, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("page_attend(Tensor q, Tensor k, Tensor v, int handle, int layer, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvslim_cpp, CPU, m) {
  m.impl("linear", &linear);
  m.impl("page_attend", &page_attend);
}
