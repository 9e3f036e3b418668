// TensorFlow custom op "StableMoments": the native kernel (moments_core/native/moments.h).
//
//   x [outer, n, inner] (or [outer, n, inner, 2]: real and imaginary parts) of float/double
//   -> mean [outer, inner] (or [outer, inner, 2]), variance [outer, inner], undecided [].
//
// More generally x has any shape (a last dimension 2 for parts = 2, not reduced) and the
// reduced axes are the contiguous range [axis_begin, axis_end): outer is the product of
// the dimensions before them, n of theirs, inner of those after; the results have x's
// shape without the reduced axes (keepdims: with them as 1).  The defaults (1, 2) are
// the rank-3 form above.  One op then serves a call: no reshape before or after.
//
// The target format (precision, emin, emax) is an attribute: float16 and bfloat16 data come
// as float32 and their results are values of their own format (exactly castable back).
//
// The same kernels serve a user's XLA computation on the CPU (tf.function(jit_compile=True),
// Keras jit_compile) as XLA custom calls, registered with TensorFlow's XLA below and
// emitted by TensorFlow's own XlaCustomCallV2 op (tf_stable_moments/_native/__init__.py).
#include <Python.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "moments.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"
#include "xla/service/custom_call_status.h"
#include "xla/service/custom_call_target_registry.h"

namespace {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

// ---- what every op on slices of x over its axes [axis_begin, axis_end) shares --------
// x's last dimension holds the two parts of complex data where parts is 2 (not reduced).

// Shape inference: the kept dimensions of x (reduced ones as 1 with keepdims), or false
// with *unknown where x's rank is unknown; an error naming `op` where the axes do not fit.
Status KeptDims(InferenceContext* c, const char* op, int parts, int begin, int end,
                bool keepdims, std::vector<tensorflow::shape_inference::DimensionHandle>* dims,
                bool* known) {
  ShapeHandle x = c->input(0);
  *known = c->RankKnown(x);
  if (!*known) return Status();
  const int rank = c->Rank(x), data = rank - (parts == 2 ? 1 : 0);
  if (begin < 0 || begin > end || end > data) {
    return tensorflow::errors::InvalidArgument(op, ": reduced axes [", begin, ", ", end,
                                               ") do not fit rank ", rank);
  }
  for (int d = 0; d < data; ++d) {
    if (d < begin || d >= end) {
      dims->push_back(c->Dim(x, d));
    } else if (keepdims) {
      dims->push_back(c->MakeDim(1));
    }
  }
  return Status();
}

// Kernels: x read as [outer, n, inner] (moments_core.native.layout), and the shape of its
// kept axes (reduced ones as 1 with keepdims).
struct SliceLayout {
  int64_t outer = 1, n = 1, inner = 1;
  TensorShape kept;
};

// The layout of x, or an error naming `op` where the axes do not fit, a complex input has
// no last dimension 2, or a slice has 2**46 elements or more (the kernel's limit; the error
// names `fn`, the public function).
Status LayoutOf(const char* op, const char* fn, const Tensor& x, int parts, int begin, int end,
                bool keepdims, SliceLayout* out) {
  const int rank = x.dims(), data = rank - (parts == 2 ? 1 : 0);
  if (begin < 0 || begin > end || end > data) {
    return tensorflow::errors::InvalidArgument(op, ": reduced axes [", begin, ", ", end,
                                               ") do not fit rank ", rank);
  }
  if (parts == 2 && x.dim_size(data) != 2) {
    return tensorflow::errors::InvalidArgument(op, ": parts 2 needs a last dimension 2");
  }
  for (int d = 0; d < data; ++d) {
    const int64_t size = x.dim_size(d);
    (d < begin ? out->outer : d < end ? out->n : out->inner) *= size;
    if (d < begin || d >= end) {
      out->kept.AddDim(size);
    } else if (keepdims) {
      out->kept.AddDim(1);
    }
  }
  if (out->n >= (int64_t(1) << 46)) {
    return tensorflow::errors::InvalidArgument(fn, ": a slice of ", out->n,
                                               " elements exceeds the kernel's 2**46 limit");
  }
  return Status();
}

// The threads of TensorFlow's CPU device (1 where it has none).
int WorkerThreads(OpKernelContext* ctx) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  return workers ? workers->num_threads : 1;
}

REGISTER_OP("StableMoments")
    .Input("x: T")
    .Output("mean: T")
    .Output("variance: T")
    .Output("undecided: int64")
    .Attr("T: {float, double}")
    .Attr("ddof: int = 0")
    .Attr("precision: int")
    .Attr("emin: int")
    .Attr("emax: int")
    .Attr("parts: int = 1")
    .Attr("axis_begin: int = 1")
    .Attr("axis_end: int = 2")
    .Attr("keepdims: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      int parts, begin, end;
      bool keepdims;
      TF_RETURN_IF_ERROR(c->GetAttr("parts", &parts));
      TF_RETURN_IF_ERROR(c->GetAttr("axis_begin", &begin));
      TF_RETURN_IF_ERROR(c->GetAttr("axis_end", &end));
      TF_RETURN_IF_ERROR(c->GetAttr("keepdims", &keepdims));
      c->set_output(2, c->Scalar());
      std::vector<tensorflow::shape_inference::DimensionHandle> dims;
      bool known;
      TF_RETURN_IF_ERROR(KeptDims(c, "StableMoments", parts, begin, end, keepdims, &dims, &known));
      if (!known) {
        c->set_output(0, c->UnknownShape());
        c->set_output(1, c->UnknownShape());
        return Status();
      }
      c->set_output(1, c->MakeShape(dims));
      if (parts == 2) dims.push_back(c->MakeDim(2));
      c->set_output(0, c->MakeShape(dims));
      return Status();
    });

// The attributes StableMoments and StableMeanLo share: ddof, the format, parts, the axes.
struct CommonAttrs {
  stable_moments::Format format;
  int64_t ddof = 0;
  int parts = 1;
  int begin = 1, end = 2;
};

Status ReadCommonAttrs(OpKernelConstruction* ctx, const char* op, CommonAttrs& a) {
  TF_RETURN_IF_ERROR(ctx->GetAttr("ddof", &a.ddof));
  TF_RETURN_IF_ERROR(ctx->GetAttr("precision", &a.format.precision));
  TF_RETURN_IF_ERROR(ctx->GetAttr("emin", &a.format.emin));
  TF_RETURN_IF_ERROR(ctx->GetAttr("emax", &a.format.emax));
  TF_RETURN_IF_ERROR(ctx->GetAttr("parts", &a.parts));
  if (a.parts != 1 && a.parts != 2) {
    return tensorflow::errors::InvalidArgument(op, ": parts must be 1 or 2");
  }
  TF_RETURN_IF_ERROR(ctx->GetAttr("axis_begin", &a.begin));
  return ctx->GetAttr("axis_end", &a.end);
}

template <typename T>
class StableMomentsOp : public OpKernel {
 public:
  explicit StableMomentsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    CommonAttrs a;
    OP_REQUIRES_OK(ctx, ReadCommonAttrs(ctx, "StableMoments", a));
    format_ = a.format, ddof_ = a.ddof, parts_ = a.parts, begin_ = a.begin, end_ = a.end;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("keepdims", &keepdims_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    SliceLayout l;
    OP_REQUIRES_OK(ctx, LayoutOf("StableMoments", "moments", x, parts_, begin_, end_,
                                 keepdims_, &l));
    TensorShape mean_shape = l.kept;
    if (parts_ == 2) mean_shape.AddDim(2);
    Tensor* mean = nullptr;
    Tensor* var = nullptr;
    Tensor* undecided = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, mean_shape, &mean));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, l.kept, &var));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({}), &undecided));
    stable_moments::Result r = stable_moments::moments<T>(
        x.flat<T>().data(), l.outer, l.n, l.inner, parts_, ddof_, format_,
        mean->flat<T>().data(), var->flat<T>().data(), WorkerThreads(ctx));
    undecided->scalar<int64_t>()() = r.undecided;
  }

 private:
  stable_moments::Format format_;
  int64_t ddof_ = 0;
  int parts_ = 1;
  int begin_ = 1, end_ = 2;
  bool keepdims_ = false;
};

REGISTER_KERNEL_BUILDER(
    Name("StableMoments").Device(DEVICE_CPU).TypeConstraint<float>("T"),
    StableMomentsOp<float>);
REGISTER_KERNEL_BUILDER(
    Name("StableMoments").Device(DEVICE_CPU).TypeConstraint<double>("T"),
    StableMomentsOp<double>);

// "StableMeanLo": mean(x) - mean, to the format, from a fixed-point sum (docs section 9;
// moments.h `mean_lo`), for the x, mean and variance of one StableMoments call with the
// same attributes (keepdims false): one op where plain TensorFlow operations were ~150.
REGISTER_OP("StableMeanLo")
    .Input("x: T")
    .Input("mean: T")
    .Input("variance: T")
    .Output("mean_lo: T")
    .Attr("T: {float, double}")
    .Attr("ddof: int = 0")
    .Attr("precision: int")
    .Attr("emin: int")
    .Attr("emax: int")
    .Attr("parts: int = 1")
    .Attr("axis_begin: int = 1")
    .Attr("axis_end: int = 2")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(1));
      return Status();
    });

template <typename T>
class StableMeanLoOp : public OpKernel {
 public:
  explicit StableMeanLoOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    CommonAttrs a;
    OP_REQUIRES_OK(ctx, ReadCommonAttrs(ctx, "StableMeanLo", a));
    format_ = a.format, ddof_ = a.ddof, parts_ = a.parts, begin_ = a.begin, end_ = a.end;
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& mean = ctx->input(1);
    const Tensor& var = ctx->input(2);
    SliceLayout l;
    OP_REQUIRES_OK(ctx, LayoutOf("StableMeanLo", "moments", x, parts_, begin_, end_, false, &l));
    OP_REQUIRES(ctx, mean.NumElements() == l.outer * l.inner * parts_ &&
                         var.NumElements() == l.outer * l.inner,
                tensorflow::errors::InvalidArgument("StableMeanLo: mean and variance do not "
                                                    "match x's kept axes"));
    Tensor* lo = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, mean.shape(), &lo));
    stable_moments::mean_lo<T>(x.flat<T>().data(), l.outer, l.n, l.inner, parts_, ddof_,
                               format_, mean.flat<T>().data(), var.flat<T>().data(),
                               lo->flat<T>().data(), WorkerThreads(ctx));
  }

 private:
  stable_moments::Format format_;
  int64_t ddof_ = 0;
  int parts_ = 1;
  int begin_ = 1, end_ = 2;
};

REGISTER_KERNEL_BUILDER(
    Name("StableMeanLo").Device(DEVICE_CPU).TypeConstraint<float>("T"),
    StableMeanLoOp<float>);
REGISTER_KERNEL_BUILDER(
    Name("StableMeanLo").Device(DEVICE_CPU).TypeConstraint<double>("T"),
    StableMeanLoOp<double>);

// "StableCentre": the layers' batch statistics and centred input in one op (no mask, one
// real part): StableMoments and StableMeanLo of x over the range [axis_begin, axis_end),
// and r = (x - mean) - mean_lo (moments.h `residuals`).  Its gradient is registered in
// Python (tf_stable_moments/_native/__init__.py), the analytic one of the layers: the tape
// records one op where tf.custom_gradient around the three steps recorded ten.
REGISTER_OP("StableCentre")
    .Input("x: T")
    .Output("residual: T")
    .Output("variance: T")
    .Output("mean: T")
    .Output("mean_lo: T")
    .Attr("T: {float, double}")
    .Attr("ddof: int = 0")
    .Attr("precision: int")
    .Attr("emin: int")
    .Attr("emax: int")
    .Attr("parts: int = 1")
    .Attr("axis_begin: int = 1")
    .Attr("axis_end: int = 2")
    .SetShapeFn([](InferenceContext* c) {
      int begin, end;
      TF_RETURN_IF_ERROR(c->GetAttr("axis_begin", &begin));
      TF_RETURN_IF_ERROR(c->GetAttr("axis_end", &end));
      c->set_output(0, c->input(0));
      std::vector<tensorflow::shape_inference::DimensionHandle> dims;
      bool known;
      TF_RETURN_IF_ERROR(KeptDims(c, "StableCentre", 1, begin, end, false, &dims, &known));
      for (int i = 1; i < 4; ++i) c->set_output(i, known ? c->MakeShape(dims) : c->UnknownShape());
      return Status();
    });

template <typename T>
class StableCentreOp : public OpKernel {
 public:
  explicit StableCentreOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadCommonAttrs(ctx, "StableCentre", a_));
    OP_REQUIRES(ctx, a_.parts == 1,
                tensorflow::errors::InvalidArgument("StableCentre: real data only (parts 1)"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    SliceLayout l;
    OP_REQUIRES_OK(ctx, LayoutOf("StableCentre", "moments", x, 1, a_.begin, a_.end, false, &l));
    Tensor* out[4];
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &out[0]));
    for (int i = 1; i < 4; ++i) OP_REQUIRES_OK(ctx, ctx->allocate_output(i, l.kept, &out[i]));
    const T* xs = x.flat<T>().data();
    T* var = out[1]->flat<T>().data();
    T* mean = out[2]->flat<T>().data();
    T* lo = out[3]->flat<T>().data();
    const int threads = WorkerThreads(ctx);
    stable_moments::moments<T>(xs, l.outer, l.n, l.inner, 1, a_.ddof, a_.format, mean, var,
                               threads);
    stable_moments::mean_lo<T>(xs, l.outer, l.n, l.inner, 1, a_.ddof, a_.format, mean, var, lo,
                               threads);
    stable_moments::residuals<T>(xs, l.outer, l.n, l.inner, mean, lo, out[0]->flat<T>().data(),
                                threads);
  }

 private:
  CommonAttrs a_;
};

REGISTER_KERNEL_BUILDER(
    Name("StableCentre").Device(DEVICE_CPU).TypeConstraint<float>("T"),
    StableCentreOp<float>);
REGISTER_KERNEL_BUILDER(
    Name("StableCentre").Device(DEVICE_CPU).TypeConstraint<double>("T"),
    StableCentreOp<double>);

// "StableState": the mergeable moments state of every slice (docs section 13; moments.h
// `state`), x read over the range [axis_begin, axis_end) as StableMoments reads it ->
// values [kept dims..., size] int32, size = 3 + parts (l1 + 9) + l2 (`_state.Layout`).
REGISTER_OP("StableState")
    .Input("x: T")
    .Output("values: int32")
    .Attr("T: {float, double}")
    .Attr("precision: int")
    .Attr("emin: int")
    .Attr("emax: int")
    .Attr("parts: int = 1")
    .Attr("axis_begin: int = 1")
    .Attr("axis_end: int = 2")
    .Attr("l1: int")
    .Attr("l2: int")
    .SetShapeFn([](InferenceContext* c) {
      int parts, begin, end, l1, l2;
      TF_RETURN_IF_ERROR(c->GetAttr("parts", &parts));
      TF_RETURN_IF_ERROR(c->GetAttr("axis_begin", &begin));
      TF_RETURN_IF_ERROR(c->GetAttr("axis_end", &end));
      TF_RETURN_IF_ERROR(c->GetAttr("l1", &l1));
      TF_RETURN_IF_ERROR(c->GetAttr("l2", &l2));
      std::vector<tensorflow::shape_inference::DimensionHandle> dims;
      bool known;
      TF_RETURN_IF_ERROR(KeptDims(c, "StableState", parts, begin, end, false, &dims, &known));
      dims.push_back(c->MakeDim(3 + parts * (l1 + 9) + l2));
      c->set_output(0, known ? c->MakeShape(dims) : c->UnknownShape());
      return Status();
    });

template <typename T>
class StableStateOp : public OpKernel {
 public:
  explicit StableStateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("precision", &format_.precision));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("emin", &format_.emin));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("emax", &format_.emax));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("parts", &layout_.parts));
    OP_REQUIRES(ctx, layout_.parts == 1 || layout_.parts == 2,
                tensorflow::errors::InvalidArgument("StableState: parts must be 1 or 2"));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("axis_begin", &begin_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("axis_end", &end_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("l1", &layout_.l1));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("l2", &layout_.l2));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    SliceLayout l;
    OP_REQUIRES_OK(ctx, LayoutOf("StableState", "moments_state", x, layout_.parts, begin_, end_,
                                 false, &l));
    TensorShape shape = l.kept;
    shape.AddDim(layout_.size());
    Tensor* values = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &values));
    stable_moments::state<T>(x.flat<T>().data(), l.outer, l.n, l.inner, layout_.parts, format_,
                             layout_, values->flat<int32_t>().data(), WorkerThreads(ctx));
  }

 private:
  stable_moments::Format format_;
  stable_moments::StateLayout layout_{0, 0, 1};
  int begin_ = 1, end_ = 2;
};

REGISTER_KERNEL_BUILDER(Name("StableState").Device(DEVICE_CPU).TypeConstraint<float>("T"),
                        StableStateOp<float>);
REGISTER_KERNEL_BUILDER(Name("StableState").Device(DEVICE_CPU).TypeConstraint<double>("T"),
                        StableStateOp<double>);

// "StableStateMoments": (mean, variance) from moments states (docs section 13; moments.h
// `state_result`): values [..., size] int32 (canonical states or digit sums of up to 2**15
// of them) -> mean [..., parts], variance [...] of T, values of the format (precision, emin,
// emax), the bits of `state_moments`.
REGISTER_OP("StableStateMoments")
    .Input("values: int32")
    .Output("mean: T")
    .Output("variance: T")
    .Attr("T: {float, double}")
    .Attr("ddof: int = 0")
    .Attr("precision: int")
    .Attr("emin: int")
    .Attr("emax: int")
    .Attr("parts: int = 1")
    .Attr("l1: int")
    .Attr("l2: int")
    .SetShapeFn([](InferenceContext* c) {
      int parts;
      TF_RETURN_IF_ERROR(c->GetAttr("parts", &parts));
      ShapeHandle v = c->input(0), kept;
      if (!c->RankKnown(v)) {
        c->set_output(0, c->UnknownShape());
        c->set_output(1, c->UnknownShape());
        return Status();
      }
      TF_RETURN_IF_ERROR(c->Subshape(v, 0, -1, &kept));
      ShapeHandle mean;
      TF_RETURN_IF_ERROR(c->Concatenate(kept, c->Vector(parts), &mean));
      c->set_output(0, mean);
      c->set_output(1, kept);
      return Status();
    });

template <typename T>
class StableStateMomentsOp : public OpKernel {
 public:
  explicit StableStateMomentsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("ddof", &ddof_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("precision", &format_.precision));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("emin", &format_.emin));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("emax", &format_.emax));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("parts", &layout_.parts));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("l1", &layout_.l1));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("l2", &layout_.l2));
    OP_REQUIRES(ctx, layout_.parts == 1 || layout_.parts == 2,
                tensorflow::errors::InvalidArgument("StableStateMoments: parts must be 1 or 2"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& values = ctx->input(0);
    const int rank = values.dims();
    OP_REQUIRES(ctx, rank >= 1 && values.dim_size(rank - 1) == layout_.size(),
                tensorflow::errors::InvalidArgument(
                    "state_moments: a state has ", layout_.size(), " digits per slice; got ",
                    "values of shape ", values.shape().DebugString()));
    TensorShape kept;
    for (int d = 0; d + 1 < rank; ++d) kept.AddDim(values.dim_size(d));
    TensorShape mean_shape = kept;
    mean_shape.AddDim(layout_.parts);
    Tensor* mean = nullptr;
    Tensor* var = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, mean_shape, &mean));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, kept, &var));
    const int32_t* d = values.flat<int32_t>().data();
    T* m = mean->flat<T>().data();
    T* v = var->flat<T>().data();
    const int64_t slices = kept.num_elements();
    for (int64_t i = 0; i < slices; ++i) {
      OP_REQUIRES(ctx,
                  stable_moments::state_result<T>(d + i * layout_.size(), layout_, ddof_, format_,
                                                  m + i * layout_.parts, v[i]),
                  tensorflow::errors::InvalidArgument(
                      "state_moments: slice ", i, " is not a state or a sum of states (a "
                      "negative digit, or n S2 < S1**2)"));
    }
  }

 private:
  stable_moments::Format format_;
  stable_moments::StateLayout layout_{0, 0, 1};
  int64_t ddof_ = 0;
};

REGISTER_KERNEL_BUILDER(
    Name("StableStateMoments").Device(DEVICE_CPU).TypeConstraint<float>("T"),
    StableStateMomentsOp<float>);
REGISTER_KERNEL_BUILDER(
    Name("StableStateMoments").Device(DEVICE_CPU).TypeConstraint<double>("T"),
    StableStateMomentsOp<double>);


// "StableStallCheck": the stall test of tf_stable_moments/_advice.py `check` in a graph,
// as one op instead of a tf.cond around a tf.py_function (whose branches cost a deep model
// seconds of tracing).  Per channel: stalled when |mean - moving| * (1 - momentum) is
// below half an ulp of moving and |mean - moving| > threshold * sqrt(var + epsilon).  The
// first time a channel of layer `token` stalls, the op takes the GIL and calls
// tf_stable_moments._advice._native_report(token, moving, mean, var) (Python lists),
// which warns once; afterwards it returns at once.
REGISTER_OP("StableStallCheck")
    .Input("moving_mean: float")
    .Input("mean: float")
    .Input("variance: float")
    .Attr("momentum: float")
    .Attr("epsilon: float")
    .Attr("threshold: float")
    .Attr("token: int")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) { return Status(); });

std::mutex stall_mutex;
std::set<int64_t> stall_reported;

PyObject* list_of(const float* v, int64_t n) {
  PyObject* list = PyList_New(n);
  for (int64_t i = 0; list && i < n; ++i) PyList_SET_ITEM(list, i, PyFloat_FromDouble(v[i]));
  return list;
}

// The stall check of layer `token` (StableStallCheck and the XLA call below): true once it
// has reported (the caller may stop checking).  The first time a channel stalls, takes the
// GIL and calls tf_stable_moments._advice._native_report(token, moving, mean, var).
bool StallCheck(const float* m, const float* b, const float* v, int64_t n, float momentum,
                float epsilon, float threshold, int64_t token) {
  if (!stable_moments::any_stalled(m, b, v, n, momentum, epsilon, threshold)) return false;
  {
    std::lock_guard<std::mutex> lock(stall_mutex);
    if (!stall_reported.insert(token).second) return true;
  }
  if (!Py_IsInitialized()) return true;
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* module = PyImport_ImportModule("tf_stable_moments._advice");
  PyObject* result = nullptr;
  if (module) {
    result = PyObject_CallMethod(module, "_native_report", "LNNN",
                                 static_cast<long long>(token), list_of(m, n), list_of(b, n),
                                 list_of(v, n));
  }
  if (!result) PyErr_Print();
  Py_XDECREF(result);
  Py_XDECREF(module);
  PyGILState_Release(gil);
  return true;
}

class StableStallCheckOp : public OpKernel {
 public:
  explicit StableStallCheckOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("momentum", &momentum_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &epsilon_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("threshold", &threshold_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("token", &token_));
  }

  void Compute(OpKernelContext* ctx) override {
    if (done_.load(std::memory_order_relaxed)) return;
    const Tensor& moving = ctx->input(0);
    const Tensor& mean = ctx->input(1);
    const Tensor& var = ctx->input(2);
    const int64_t n = moving.NumElements();
    OP_REQUIRES(ctx, mean.NumElements() == n && var.NumElements() == n,
                tensorflow::errors::InvalidArgument("StableStallCheck: sizes differ"));
    if (StallCheck(moving.flat<float>().data(), mean.flat<float>().data(),
                   var.flat<float>().data(), n, momentum_, epsilon_, threshold_, token_)) {
      done_ = true;
    }
  }

 private:
  float momentum_ = 0.99f, epsilon_ = 1e-3f, threshold_ = 0.1f;
  int64_t token_ = 0;
  std::atomic<bool> done_{false};
};

REGISTER_KERNEL_BUILDER(Name("StableStallCheck").Device(DEVICE_CPU), StableStallCheckOp);

// "StableScaleShift" and "StableBlend": the layers' output formulas of docs section 14
// (moments_core/_affine.py `scale_shift32`, `blend32`) as CPU ops, so that TensorFlow
// outside XLA (eager mode, tf.function without jit_compile) runs them as one op per layer
// with nothing to compile per shape.  Compiled with -ffp-contract=off: every operation
// below is one IEEE operation, the products of two float32 are exact in double, and each
// conversion double -> float rounds once to nearest even: the values of the formulas,
// whose roundings no compiler can change.  Subnormal inputs and results are flushed to
// zero (sign kept), as TensorFlow's and XLA's CPU kernels do, so the bits are those of
// the XLA formulas on the CPU.
REGISTER_OP("StableScaleShift")
    .Input("r: float")
    .Input("v: float")
    .Input("gamma: float")
    .Input("beta: float")
    .Attr("has_gamma: bool")
    .Attr("has_beta: bool")
    .Attr("shared: bool")
    .Output("y: float")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      return Status();
    });

REGISTER_OP("StableBlend")
    .Input("a: float")
    .Input("wa: float")
    .Input("b: float")
    .Input("wb: float")
    .Output("y: float")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      return Status();
    });

inline float Flush(float a) { return stable_moments::flush_subnormal(a); }

// The formulas' float32 result: flushed, and any NaN the quiet NaN 0x7FC00000
// (_affine.canonical_nan: a NaN's sign and payload follow the operand order).
inline float Round(double a) {
  const float y = Flush(static_cast<float>(a));
  return y != y ? std::numeric_limits<float>::quiet_NaN() : y;
}

// Strides (in elements) of `operand` broadcast against `shape` (numpy rules: trailing
// dimensions aligned, size-1 or missing dimensions repeated): 0 where it is repeated.
bool BroadcastStrides(const TensorShape& operand, const TensorShape& shape,
                      std::vector<int64_t>* strides) {
  const int rank = shape.dims(), own = operand.dims();
  if (own > rank) return false;
  strides->assign(rank, 0);
  int64_t stride = 1;
  for (int k = own - 1; k >= 0; --k) {
    const int64_t d = operand.dim_size(k), full = shape.dim_size(rank - own + k);
    if (d != 1 && d != full) return false;
    (*strides)[rank - own + k] = d == 1 ? 0 : stride;
    stride *= d;
  }
  return true;
}

// Calls body(i, n, offsets, steps) for the rows [first, last) of the last dimension of
// `shape` (row-major): elements i .. i + n - 1; operand j's element k of the row is
// offsets[j] + k * steps[j] (its broadcast strides).  Rank 0 is one row of one element.
template <typename Body>
void ForEachRow(const TensorShape& shape, const std::vector<std::vector<int64_t>>& strides,
                int64_t first, int64_t last, Body body) {
  const int rank = shape.dims();
  const size_t k = strides.size();
  const int64_t n = rank ? shape.dim_size(rank - 1) : 1;
  std::vector<int64_t> index(rank, 0), offsets(k, 0), steps(k, 0);
  for (size_t j = 0; j < k; ++j) steps[j] = rank ? strides[j][rank - 1] : 0;
  for (int64_t d = rank - 2, rest = first; d >= 0; --d) {  // row `first`'s index
    index[d] = rest % shape.dim_size(d);
    rest /= shape.dim_size(d);
    for (size_t j = 0; j < k; ++j) offsets[j] += index[d] * strides[j][d];
  }
  for (int64_t row = first; row < last; ++row) {
    body(row * n, n, offsets.data(), steps.data());
    for (int d = rank - 2; d >= 0; --d) {  // the odometer over the outer dimensions
      if (++index[d] < shape.dim_size(d)) {
        for (size_t j = 0; j < k; ++j) offsets[j] += strides[j][d];
        break;
      }
      for (size_t j = 0; j < k; ++j) offsets[j] -= strides[j][d] * (shape.dim_size(d) - 1);
      index[d] = 0;
    }
  }
}

// ForEachRow over every row, sharded over TensorFlow's CPU worker threads (each element
// is computed alone: the bits do not depend on the sharding).  `cycles`: the cost of one
// element for the pool's cost model (Eigen's: a piece per about 10**5 cycles), which runs
// small tensors inline.  Measured on this 2-core VM (one call of StableScaleShift's
// per-channel loop, the BN layers' case, inside a tf.function): with 20 cycles an element
// the pool split float32 [256, 128] and [8, 16, 16, 32] and took 69-85 and 103-125 us a
// call; with 2 cycles they run inline in 29-31 and 59 us (TensorFlow's r * f + b: 27-33
// and 53-60 us), and [16, 16, 16, 64] and larger are still split, as fast as before.  The
// other loops in the same proportion to their time on one thread (float32 [64, 32, 32,
// 64]: the per-channel loop 2.0 ns an element): StableScaleShift's general loop (strided
// operands) 6.7 ns, 6 cycles; StableBlend 3.5 ns, 4 cycles.
template <typename Body>
void ForEachRowParallel(OpKernelContext* ctx, const TensorShape& shape,
                        const std::vector<std::vector<int64_t>>& strides, int64_t cycles,
                        Body body) {
  const int rank = shape.dims();
  const int64_t n = rank ? shape.dim_size(rank - 1) : 1;
  if (shape.num_elements() == 0 || n == 0) return;
  const int64_t rows = shape.num_elements() / n;
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  tensorflow::Shard(workers->num_threads, workers->workers, rows, cycles * n,
                    [&](int64_t first, int64_t last) {
                      ForEachRow(shape, strides, first, last, body);
                    });
}

// One element of StableScaleShift (r, its t, gamma and beta values).
inline float ScaleShift(float r, float t, float g, float b, bool has_gamma, bool has_beta,
                        bool shared) {
  const double x = Flush(r), ti = t;
  double factor = ti, value = x;
  if (has_gamma) {
    if (shared) {  // f = RN32(gamma t), y = RN32(RN64(r f + beta))
      factor = Round(static_cast<double>(Flush(g)) * ti);
    } else {  // p = RN32(r t), y = RN32(RN64(p gamma + beta))
      value = Round(x * ti);
      factor = Flush(g);
    }
  }
  const double product = value * factor;  // exact: two float32 values
  return Round(has_beta ? product + static_cast<double>(Flush(b)) : product);
}

class StableScaleShiftOp : public OpKernel {
 public:
  explicit StableScaleShiftOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("has_gamma", &has_gamma_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("has_beta", &has_beta_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shared", &shared_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& r = ctx->input(0);
    const TensorShape& shape = r.shape();
    std::vector<std::vector<int64_t>> strides(3);
    for (int j = 0; j < 3; ++j) {
      OP_REQUIRES(ctx, BroadcastStrides(ctx->input(j + 1).shape(), shape, &strides[j]),
                  tensorflow::errors::InvalidArgument(
                      "StableScaleShift: operand ", j + 1, " of shape ",
                      ctx->input(j + 1).shape().DebugString(), " does not broadcast to ",
                      shape.DebugString()));
    }
    const float* v = ctx->input(1).flat<float>().data();
    std::vector<float> t(ctx->input(1).NumElements());
    for (size_t i = 0; i < t.size(); ++i) t[i] = stable_moments::rsqrt32(v[i]);
    const float* rr = r.flat<float>().data();
    const float* g = ctx->input(2).flat<float>().data();
    const float* b = ctx->input(3).flat<float>().data();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
    float* y = out->flat<float>().data();
    const bool has_gamma = has_gamma_, has_beta = has_beta_, shared = shared_;
    const float* tv = t.data();
    // BatchNormalization, channels last: t, gamma and beta vary along the last axis
    // only, so every row has the same factors f = RN32(gamma t) and shifts: computed
    // once here, then a loop the compiler vectorizes (the same operations as
    // ScaleShift, element by element).  Per row they cost more than the row itself
    // where rows are short (a MobileNet's [8, 16, 16, 32]: 2,048 rows of 32).
    const int rank = shape.dims();
    bool per_channel = has_gamma && has_beta && shared && rank > 0;
    for (int j = 0; j < 3 && per_channel; ++j) {
      for (int d = 0; d < rank; ++d) {
        per_channel = per_channel && strides[j][d] == (d == rank - 1 ? 1 : 0);
      }
    }
    std::vector<double> f, c;
    if (per_channel) {
      const int64_t n = shape.dim_size(rank - 1);
      f.resize(n);
      c.resize(n);
      for (int64_t k = 0; k < n; ++k) {
        f[k] = Round(static_cast<double>(Flush(g[k])) * tv[k]);
        c[k] = Flush(b[k]);
      }
    }
    const double* fv = f.data();
    const double* cv = c.data();
    ForEachRowParallel(ctx, shape, strides, per_channel ? 2 : 6,
                       [&](int64_t i, int64_t n, const int64_t* o, const int64_t* s) {
      if (per_channel) {
        for (int64_t k = 0; k < n; ++k) {
          y[i + k] = Round(static_cast<double>(Flush(rr[i + k])) * fv[k] + cv[k]);
        }
        return;
      }
      for (int64_t k = 0; k < n; ++k) {
        y[i + k] = ScaleShift(rr[i + k], tv[o[0] + k * s[0]], g[o[1] + k * s[1]],
                              b[o[2] + k * s[2]], has_gamma, has_beta, shared);
      }
    });
  }

 private:
  bool has_gamma_ = true, has_beta_ = true, shared_ = false;
};

REGISTER_KERNEL_BUILDER(Name("StableScaleShift").Device(DEVICE_CPU), StableScaleShiftOp);

class StableBlendOp : public OpKernel {
 public:
  explicit StableBlendOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const TensorShape& shape = ctx->input(0).shape();
    std::vector<std::vector<int64_t>> strides(4);
    for (int j = 0; j < 4; ++j) {
      OP_REQUIRES(ctx, BroadcastStrides(ctx->input(j).shape(), shape, &strides[j]),
                  tensorflow::errors::InvalidArgument(
                      "StableBlend: operand ", j, " of shape ",
                      ctx->input(j).shape().DebugString(), " does not broadcast to ",
                      shape.DebugString()));
    }
    const float* in[4];
    for (int j = 0; j < 4; ++j) in[j] = ctx->input(j).flat<float>().data();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
    float* y = out->flat<float>().data();
    ForEachRowParallel(ctx, shape, strides, 4,
                       [&](int64_t i, int64_t n, const int64_t* o, const int64_t* s) {
      for (int64_t k = 0; k < n; ++k) {  // RN32(RN64(a wa + b wb)): products exact
        const double p = static_cast<double>(Flush(in[0][o[0] + k * s[0]])) *
                         Flush(in[1][o[1] + k * s[1]]);
        const double q = static_cast<double>(Flush(in[2][o[2] + k * s[2]])) *
                         Flush(in[3][o[3] + k * s[3]]);
        y[i + k] = Round(p + q);
      }
    });
  }
};

REGISTER_KERNEL_BUILDER(Name("StableBlend").Device(DEVICE_CPU), StableBlendOp);

// ------------------------------------------------------------------ XLA custom calls
// Inside a user's XLA computation on the CPU no TensorFlow kernel runs: the Python wrapper
// emits TensorFlow's own XlaCustomCallV2 op there, which XLA compiles into a call of one of
// the functions below (registered for the "Host" platform when this library loads; the
// form XlaCustomCallV2 emits: STATUS_RETURNING_UNIFIED, row-major buffers, a tuple result
// as an array of buffers).  XLA compiles nothing of the kernel itself, so a model's first
// jit_compile step costs about what it costs with keras's layers.  The opaque string (the
// op's backend_config, fixed when the graph is traced) holds the attributes; x's shape,
// which may be known only when XLA compiles, comes as an int64 operand.

// "tf_stable_moments_moments": StableMoments, and with lo = 1 StableMeanLo, in one call.
//   in:  x (as the ops' input), int64 [rank] x's shape
//   out: (mean, variance, undecided int64 []), with lo (mean, variance, mean_lo, undecided)
//   opaque: "bytes rank ddof precision emin emax parts axis_begin axis_end lo" (bytes 4, 8)
// The wrapper checks the attributes when it traces (the same checks as the ops').
template <typename T>
void XlaMoments(void** out, const void** in, const CommonAttrs& a, int rank, bool lo) {
  const int64_t* shape = static_cast<const int64_t*>(in[1]);
  const int data = rank - (a.parts == 2 ? 1 : 0);
  int64_t outer = 1, n = 1, inner = 1;
  for (int d = 0; d < data; ++d) (d < a.begin ? outer : d < a.end ? n : inner) *= shape[d];
  const T* x = static_cast<const T*>(in[0]);
  T* mean = static_cast<T*>(out[0]);
  T* var = static_cast<T*>(out[1]);
  stable_moments::Result r = stable_moments::moments<T>(x, outer, n, inner, a.parts, a.ddof,
                                                        a.format, mean, var,
                                                        stable_moments::machine_threads());
  if (lo) {
    stable_moments::mean_lo<T>(x, outer, n, inner, a.parts, a.ddof, a.format, mean, var,
                               static_cast<T*>(out[2]), stable_moments::machine_threads());
  }
  *static_cast<int64_t*>(out[lo ? 3 : 2]) = r.undecided;
}

void tf_stable_moments_moments(void* out, const void** in, const char* opaque,
                               size_t opaque_len, XlaCustomCallStatus*) {
  std::string config(opaque, opaque_len);
  CommonAttrs a;
  int bytes = 0, rank = 0, lo = 0;
  long long ddof = 0;
  if (std::sscanf(config.c_str(), "%d %d %lld %d %d %d %d %d %d %d", &bytes, &rank, &ddof,
                  &a.format.precision, &a.format.emin, &a.format.emax, &a.parts, &a.begin,
                  &a.end, &lo) != 10) {
    return;  // not emitted by the wrapper (no error channel: XLA's setter is not exported)
  }
  a.ddof = ddof;
  void** outs = static_cast<void**>(out);
  if (bytes == 8) {
    XlaMoments<double>(outs, in, a, rank, lo != 0);
  } else {
    XlaMoments<float>(outs, in, a, rank, lo != 0);
  }
}

// "tf_stable_moments_stall_check": StableStallCheck inside XLA.  It returns the moving mean
// it was given (the layer updates from that output, so XLA keeps the call).
//   in:  moving_mean, mean, variance (float32 [c]), int64 [1] c;  out: moving_mean
//   opaque: "momentum epsilon threshold token"
void tf_stable_moments_stall_check(void* out, const void** in, const char* opaque,
                                   size_t opaque_len, XlaCustomCallStatus*) {
  const int64_t n = *static_cast<const int64_t*>(in[3]);
  const float* moving = static_cast<const float*>(in[0]);
  std::memcpy(out, moving, sizeof(float) * n);
  std::string config(opaque, opaque_len);
  float momentum = 0, epsilon = 0, threshold = 0;
  long long token = 0;
  if (std::sscanf(config.c_str(), "%f %f %f %lld", &momentum, &epsilon, &threshold,
                  &token) != 4) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(stall_mutex);
    if (stall_reported.count(token)) return;  // this layer has warned
  }
  StallCheck(moving, static_cast<const float*>(in[1]), static_cast<const float*>(in[2]), n,
             momentum, epsilon, threshold, token);
}

// "tf_stable_moments_state": StableState inside XLA.
//   in:  x (as the op's input), int64 [rank] x's shape;  out: values int32 [kept, size]
//   opaque: "bytes rank precision emin emax parts axis_begin axis_end l1 l2"
void tf_stable_moments_state(void* out, const void** in, const char* opaque,
                             size_t opaque_len, XlaCustomCallStatus*) {
  std::string config(opaque, opaque_len);
  stable_moments::Format f;
  stable_moments::StateLayout s{0, 0, 1};
  int bytes = 0, rank = 0, begin = 0, end = 0;
  if (std::sscanf(config.c_str(), "%d %d %d %d %d %d %d %d %d %d", &bytes, &rank, &f.precision,
                  &f.emin, &f.emax, &s.parts, &begin, &end, &s.l1, &s.l2) != 10) {
    return;  // not emitted by the wrapper (no error channel: XLA's setter is not exported)
  }
  const int64_t* shape = static_cast<const int64_t*>(in[1]);
  const int data = rank - (s.parts == 2 ? 1 : 0);
  int64_t outer = 1, n = 1, inner = 1;
  for (int d = 0; d < data; ++d) (d < begin ? outer : d < end ? n : inner) *= shape[d];
  int32_t* values = static_cast<int32_t*>(out);
  const int threads = stable_moments::machine_threads();
  if (bytes == 8) {
    stable_moments::state<double>(static_cast<const double*>(in[0]), outer, n, inner, s.parts,
                                  f, s, values, threads);
  } else {
    stable_moments::state<float>(static_cast<const float*>(in[0]), outer, n, inner, s.parts, f,
                                 s, values, threads);
  }
}

// "tf_stable_moments_rsqrt": rsqrt32 (moments.h) of a float32 vector inside XLA: the per-channel
// factor t of the layers' output formulas (docs section 14), the bits of _affine.rsqrt32.
// As XLA operations it was some 60 operations compiled into every layer (a ResNet50's
// first jit_compile step: about 1.5 s of 2.5 s over keras's).
//   in:  v (float32 [n]), int64 [1] n;  out: t (float32 [n])
void tf_stable_moments_rsqrt(void* out, const void** in, const char*, size_t,
                             XlaCustomCallStatus*) {
  const int64_t n = *static_cast<const int64_t*>(in[1]);
  const float* v = static_cast<const float*>(in[0]);
  float* t = static_cast<float*>(out);
  for (int64_t i = 0; i < n; ++i) t[i] = stable_moments::rsqrt32(v[i]);
}

// Registered once per process (a second copy of this library, loaded from elsewhere, finds
// the names taken and leaves them: XLA refuses two addresses for one name).
struct RegisterXlaTargets {
  RegisterXlaTargets() {
    auto* registry = xla::CustomCallTargetRegistry::Global();
    const std::pair<const char*, void*> targets[] = {
        {"tf_stable_moments_moments", reinterpret_cast<void*>(&tf_stable_moments_moments)},
        {"tf_stable_moments_stall_check",
         reinterpret_cast<void*>(&tf_stable_moments_stall_check)},
        {"tf_stable_moments_state", reinterpret_cast<void*>(&tf_stable_moments_state)},
        {"tf_stable_moments_rsqrt", reinterpret_cast<void*>(&tf_stable_moments_rsqrt)},
    };
    for (const auto& [name, address] : targets) {
      if (registry->Lookup(name, "Host") == nullptr) registry->Register(name, address, "Host");
    }
  }
} register_xla_targets;

}  // namespace
