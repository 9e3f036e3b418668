// XLA FFI custom call "stable_moments": the native kernel (moments_core/native/moments.h)
// for JAX on CPU.
//
//   x [..., n, inner, parts] of F32 or F64 (parts 1, or 2: real and imaginary parts)
//   -> mean [..., inner, parts] (x's dtype), var [..., inner] (x's dtype), undecided s64 [b].
//
// Every dimension before the last three is flattened into the kernel's `outer`: a batch
// dimension that vmap adds in front (vmap_method "expand_dims" / "broadcast_all") is just
// more slices.  undecided (the slices the rounding test left to the exact path) has any
// shape of m elements, m dividing outer: count g is that of the g-th of m equal groups of
// outer (the call returns s64 []; vmap turns it into [batch], one count per batch element).
// Attributes: ddof, precision, emin, emax (the target format: float16 and bfloat16 data
// come as float32, and their results are values of their own format, exactly castable back).
#include <atomic>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>

#include "moments.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The target format from a call's attributes (precision, emin, emax).
stable_moments::Format FormatOf(int64_t precision, int64_t emin, int64_t emax) {
  stable_moments::Format f;
  f.precision = static_cast<int>(precision);
  f.emin = static_cast<int>(emin);
  f.emax = static_cast<int>(emax);
  return f;
}


// groups calls of the kernel, each on outer / groups consecutive blocks of x.
template <typename T>
void Run(const ffi::AnyBuffer& x, int64_t outer, int64_t n, int64_t inner, int parts,
         int64_t ddof, const stable_moments::Format& f, ffi::Result<ffi::AnyBuffer>& mean,
         ffi::Result<ffi::AnyBuffer>& var, int64_t groups, int64_t* undecided) {
  const int64_t per = groups > 0 ? outer / groups : 0;
  const T* xs = x.typed_data<T>();
  T* ms = mean->typed_data<T>();
  T* vs = var->typed_data<T>();
  for (int64_t g = 0; g < groups; ++g) {
    stable_moments::Result r = stable_moments::moments<T>(
        xs + g * per * n * inner * parts, per, n, inner, parts, ddof, f,
        ms + g * per * inner * parts, vs + g * per * inner, stable_moments::machine_threads());
    undecided[g] = r.undecided;
  }
}

ffi::Error StableMomentsImpl(ffi::AnyBuffer x, int64_t ddof, int64_t precision, int64_t emin,
                             int64_t emax, ffi::Result<ffi::AnyBuffer> mean,
                             ffi::Result<ffi::AnyBuffer> var,
                             ffi::Result<ffi::AnyBuffer> undecided) {
  auto dims = x.dimensions();
  const size_t rank = dims.size();
  if (rank < 3) {
    return ffi::Error::InvalidArgument(
        "stable_moments: x must have rank >= 3 ([..., n, inner, parts]), got rank " +
        std::to_string(rank));
  }
  int64_t outer = 1;
  for (size_t d = 0; d + 3 < rank; ++d) outer *= dims[d];
  const int64_t n = dims[rank - 3], inner = dims[rank - 2], parts = dims[rank - 1];
  if (parts != 1 && parts != 2) {
    return ffi::Error::InvalidArgument("stable_moments: the last dimension (parts) must be 1 "
                                       "or 2, got " + std::to_string(parts));
  }
  if (n >= (int64_t(1) << 46)) {
    return ffi::Error::InvalidArgument("moments: a slice of " + std::to_string(n) +
                                       " elements exceeds the kernel's 2**46 limit");
  }
  if (ddof < 0) return ffi::Error::InvalidArgument("stable_moments: ddof must be >= 0");
  if (mean->element_type() != x.element_type() || var->element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument("stable_moments: outputs must have x's dtype");
  }
  if (mean->element_count() != outer * inner * parts ||
      var->element_count() != outer * inner) {
    return ffi::Error::InvalidArgument("stable_moments: output shapes do not match x");
  }
  const int64_t groups = static_cast<int64_t>(undecided->element_count());
  if (undecided->element_type() != ffi::DataType::S64 ||
      (groups == 0 ? outer != 0 : outer % groups != 0)) {
    return ffi::Error::InvalidArgument(
        "stable_moments: undecided must be s64 with a count of elements dividing outer");
  }
  const stable_moments::Format f = FormatOf(precision, emin, emax);
  int64_t* counts = undecided->typed_data<int64_t>();
  switch (x.element_type()) {
    case ffi::DataType::F32:
      if (f.precision > 24) {
        return ffi::Error::InvalidArgument("stable_moments: float32 data with precision > 24");
      }
      Run<float>(x, outer, n, inner, static_cast<int>(parts), ddof, f, mean, var, groups, counts);
      break;
    case ffi::DataType::F64:
      Run<double>(x, outer, n, inner, static_cast<int>(parts), ddof, f, mean, var, groups, counts);
      break;
    default:
      return ffi::Error::InvalidArgument("stable_moments: x must be float32 or float64");
  }
  return ffi::Error::Success();
}

// "stable_mean_lo": mean(x) - mean to the format from a fixed-point sum (docs section 9;
// moments.h `mean_lo`) for x [..., n, inner, parts] and the mean [..., inner, parts] and
// var [..., inner] of one stable_moments call with the same attributes -> lo like mean.
ffi::Error StableMeanLoImpl(ffi::AnyBuffer x, ffi::AnyBuffer mean, ffi::AnyBuffer var,
                            int64_t ddof, int64_t precision, int64_t emin, int64_t emax,
                            ffi::Result<ffi::AnyBuffer> lo) {
  auto dims = x.dimensions();
  const size_t rank = dims.size();
  if (rank < 3) return ffi::Error::InvalidArgument("stable_mean_lo: x must have rank >= 3");
  int64_t outer = 1;
  for (size_t d = 0; d + 3 < rank; ++d) outer *= dims[d];
  const int64_t n = dims[rank - 3], inner = dims[rank - 2], parts = dims[rank - 1];
  if ((parts != 1 && parts != 2) || mean.element_count() != outer * inner * parts ||
      var.element_count() != outer * inner || lo->element_count() != mean.element_count() ||
      mean.element_type() != x.element_type() || var.element_type() != x.element_type() ||
      lo->element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument("stable_mean_lo: shapes or dtypes do not match x");
  }
  const stable_moments::Format f = FormatOf(precision, emin, emax);
  const int p = static_cast<int>(parts);
  switch (x.element_type()) {
    case ffi::DataType::F32:
      stable_moments::mean_lo<float>(x.typed_data<float>(), outer, n, inner, p, ddof, f,
                                     mean.typed_data<float>(), var.typed_data<float>(),
                                     lo->typed_data<float>(), stable_moments::machine_threads());
      break;
    case ffi::DataType::F64:
      stable_moments::mean_lo<double>(x.typed_data<double>(), outer, n, inner, p, ddof, f,
                                      mean.typed_data<double>(), var.typed_data<double>(),
                                      lo->typed_data<double>(), stable_moments::machine_threads());
      break;
    default:
      return ffi::Error::InvalidArgument("stable_mean_lo: x must be float32 or float64");
  }
  return ffi::Error::Success();
}

// "stable_state": the mergeable moments state of every slice (docs section 13; moments.h
// `state`) of x [..., n, inner, parts] (F32 or F64) -> values S32 [..., inner, size],
// size = 3 + parts (l1 + 9) + l2 (`_state.Layout`).
ffi::Error StableStateImpl(ffi::AnyBuffer x, int64_t precision, int64_t emin, int64_t emax,
                           int64_t l1, int64_t l2, ffi::Result<ffi::AnyBuffer> values) {
  auto dims = x.dimensions();
  const size_t rank = dims.size();
  if (rank < 3) return ffi::Error::InvalidArgument("stable_state: x must have rank >= 3");
  int64_t outer = 1;
  for (size_t d = 0; d + 3 < rank; ++d) outer *= dims[d];
  const int64_t n = dims[rank - 3], inner = dims[rank - 2], parts = dims[rank - 1];
  const stable_moments::StateLayout layout{static_cast<int>(l1), static_cast<int>(l2),
                                           static_cast<int>(parts)};
  if ((parts != 1 && parts != 2) || values->element_type() != ffi::DataType::S32 ||
      static_cast<int64_t>(values->element_count()) != outer * inner * layout.size()) {
    return ffi::Error::InvalidArgument("stable_state: shapes or dtypes do not match x");
  }
  if (n >= (int64_t(1) << 46)) {
    return ffi::Error::InvalidArgument("moments_state: a slice of " + std::to_string(n) +
                                       " elements exceeds the 2**46 limit");
  }
  const stable_moments::Format f = FormatOf(precision, emin, emax);
  int32_t* out = values->typed_data<int32_t>();
  const int threads = stable_moments::machine_threads();
  switch (x.element_type()) {
    case ffi::DataType::F32:
      stable_moments::state<float>(x.typed_data<float>(), outer, n, inner, layout.parts, f,
                                   layout, out, threads);
      break;
    case ffi::DataType::F64:
      stable_moments::state<double>(x.typed_data<double>(), outer, n, inner, layout.parts, f,
                                    layout, out, threads);
      break;
    default:
      return ffi::Error::InvalidArgument("stable_state: x must be float32 or float64");
  }
  return ffi::Error::Success();
}

// "stable_state_moments": (mean, var) from moments states (docs section 13; moments.h
// `state_result`): values S32 [..., size] (canonical states or digit sums of up to 2**15
// of them) -> mean [..., parts], var [...] of F32 or F64, values of the format (precision,
// emin, emax), the bits of `state_moments`.
template <typename T>
ffi::Error StateMomentsRun(const int32_t* d, int64_t slices, const stable_moments::StateLayout& s,
                           int64_t ddof, const stable_moments::Format& f, T* mean, T* var) {
  for (int64_t i = 0; i < slices; ++i) {
    if (!stable_moments::state_result<T>(d + i * s.size(), s, ddof, f, mean + i * s.parts,
                                         var[i])) {
      return ffi::Error::InvalidArgument("state_moments: slice " + std::to_string(i) +
                                         " is not a state or a sum of states (a negative "
                                         "digit, or n S2 < S1**2)");
    }
  }
  return ffi::Error::Success();
}

ffi::Error StableStateMomentsImpl(ffi::AnyBuffer values, int64_t ddof, int64_t precision,
                                  int64_t emin, int64_t emax, int64_t l1, int64_t l2,
                                  ffi::Result<ffi::AnyBuffer> mean,
                                  ffi::Result<ffi::AnyBuffer> var) {
  const int64_t count = static_cast<int64_t>(values.element_count());
  const int64_t slices = static_cast<int64_t>(var->element_count());
  const int64_t parts = slices > 0 ? static_cast<int64_t>(mean->element_count()) / slices : 1;
  const stable_moments::StateLayout s{static_cast<int>(l1), static_cast<int>(l2),
                                      static_cast<int>(parts)};
  if (values.element_type() != ffi::DataType::S32 || (parts != 1 && parts != 2) ||
      count != slices * s.size() || mean->element_type() != var->element_type() || ddof < 0) {
    return ffi::Error::InvalidArgument("stable_state_moments: shapes or dtypes do not match");
  }
  const stable_moments::Format f = FormatOf(precision, emin, emax);
  const int32_t* d = values.typed_data<int32_t>();
  switch (mean->element_type()) {
    case ffi::DataType::F32:
      return StateMomentsRun<float>(d, slices, s, ddof, f, mean->typed_data<float>(),
                                    var->typed_data<float>());
    case ffi::DataType::F64:
      return StateMomentsRun<double>(d, slices, s, ddof, f, mean->typed_data<double>(),
                                     var->typed_data<double>());
    default:
      return ffi::Error::InvalidArgument("stable_state_moments: results must be F32 or F64");
  }
}

// "stable_stall_check": the stall test of tf_stable_moments/_advice.py `check` for the
// layers on the JAX backend, as one custom call instead of a lax.cond around a
// jax.debug.callback (which cost a compiled training step about 0.5 ms per layer on a
// 2-core CPU, taken or not).  moving, mean, var: F32 [c] -> moving again (the caller
// uses it, so XLA keeps the call).  The test is moments.h `any_stalled`, as in the TF
// op StableStallCheck.  The first time a channel of
// layer `token` stalls, the reporter set by SetStallReporter (a ctypes callback, which
// takes the GIL itself) is called with the three vectors; afterwards nothing is tested.
using StallReporter = void (*)(int64_t token, const float* moving, const float* mean,
                               const float* var, int64_t n);
std::atomic<StallReporter> stall_reporter{nullptr};
std::mutex stall_mutex;
std::set<int64_t> stall_reported;

ffi::Error StableStallCheckImpl(ffi::Buffer<ffi::F32> moving, ffi::Buffer<ffi::F32> mean,
                                ffi::Buffer<ffi::F32> var, float momentum, float epsilon,
                                float threshold, int64_t token,
                                ffi::ResultBuffer<ffi::F32> out) {
  const int64_t n = static_cast<int64_t>(moving.element_count());
  if (static_cast<int64_t>(mean.element_count()) != n ||
      static_cast<int64_t>(var.element_count()) != n ||
      static_cast<int64_t>(out->element_count()) != n) {
    return ffi::Error::InvalidArgument("stable_stall_check: sizes differ");
  }
  const float* m = moving.typed_data();
  const float* b = mean.typed_data();
  const float* v = var.typed_data();
  std::copy(m, m + n, out->typed_data());
  {
    std::lock_guard<std::mutex> lock(stall_mutex);
    if (stall_reported.count(token)) return ffi::Error::Success();
  }
  if (!stable_moments::any_stalled(m, b, v, n, momentum, epsilon, threshold)) {
    return ffi::Error::Success();
  }
  {
    std::lock_guard<std::mutex> lock(stall_mutex);
    if (!stall_reported.insert(token).second) return ffi::Error::Success();
  }
  StallReporter report = stall_reporter.load();
  if (report != nullptr) report(token, m, b, v, n);
  return ffi::Error::Success();
}

// "stable_rsqrt": moments.h rsqrt32 of every element of a float32 array: the per-channel
// factor t = RN32(1 / sqrt(var + eps)) of the layers' output formulas (docs section 14),
// the bits of moments_core/_affine.py rsqrt32.  As XLA operations it is some 60
// operations compiled into every layer (a ResNet50's first JAX jit step: about 0.6 s).
ffi::Error StableRsqrtImpl(ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> t) {
  const int64_t n = static_cast<int64_t>(v.element_count());
  if (static_cast<int64_t>(t->element_count()) != n) {
    return ffi::Error::InvalidArgument("stable_rsqrt: sizes differ");
  }
  const float* in = v.typed_data();
  float* out = t->typed_data();
  for (int64_t i = 0; i < n; ++i) out[i] = stable_moments::rsqrt32(in[i]);
  return ffi::Error::Success();
}

}  // namespace

extern "C" void SetStallReporter(StallReporter report) { stall_reporter.store(report); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(StableStallCheck, StableStallCheckImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // moving
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mean
                                  .Arg<ffi::Buffer<ffi::F32>>()  // var
                                  .Attr<float>("momentum")
                                  .Attr<float>("epsilon")
                                  .Attr<float>("threshold")
                                  .Attr<int64_t>("token")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // moving

XLA_FFI_DEFINE_HANDLER_SYMBOL(StableMoments, StableMomentsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Attr<int64_t>("ddof")
                                  .Attr<int64_t>("precision")
                                  .Attr<int64_t>("emin")
                                  .Attr<int64_t>("emax")
                                  .Ret<ffi::AnyBuffer>()                 // mean
                                  .Ret<ffi::AnyBuffer>()                 // var
                                  .Ret<ffi::AnyBuffer>());                // undecided

XLA_FFI_DEFINE_HANDLER_SYMBOL(StableMeanLo, StableMeanLoImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // mean
                                  .Arg<ffi::AnyBuffer>()  // var
                                  .Attr<int64_t>("ddof")
                                  .Attr<int64_t>("precision")
                                  .Attr<int64_t>("emin")
                                  .Attr<int64_t>("emax")
                                  .Ret<ffi::AnyBuffer>());  // mean_lo

XLA_FFI_DEFINE_HANDLER_SYMBOL(StableState, StableStateImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Attr<int64_t>("precision")
                                  .Attr<int64_t>("emin")
                                  .Attr<int64_t>("emax")
                                  .Attr<int64_t>("l1")
                                  .Attr<int64_t>("l2")
                                  .Ret<ffi::AnyBuffer>());  // values

XLA_FFI_DEFINE_HANDLER_SYMBOL(StableStateMoments, StableStateMomentsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // values
                                  .Attr<int64_t>("ddof")
                                  .Attr<int64_t>("precision")
                                  .Attr<int64_t>("emin")
                                  .Attr<int64_t>("emax")
                                  .Attr<int64_t>("l1")
                                  .Attr<int64_t>("l2")
                                  .Ret<ffi::AnyBuffer>()   // mean
                                  .Ret<ffi::AnyBuffer>());  // var

XLA_FFI_DEFINE_HANDLER_SYMBOL(StableRsqrt, StableRsqrtImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v
                                  .Ret<ffi::Buffer<ffi::F32>>());  // t
