// TensorFlow custom op "StableMoments": the native kernel (moments_core/native/moments.h).
//
//   x [outer, n, inner] (or [outer, n, inner, 2]: real and imaginary parts) of float/double
//   -> mean [outer, inner] (or [outer, inner, 2]), variance [outer, inner], undecided [].
//
// The target format (precision, emin, emax) is an attribute: float16 and bfloat16 data come
// as float32 and their results are values of their own format (exactly castable back).
#include <cstdint>

#include "moments.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

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
    .SetShapeFn([](InferenceContext* c) {
      int parts;
      TF_RETURN_IF_ERROR(c->GetAttr("parts", &parts));
      ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), parts == 1 ? 3 : 4, &x));
      if (parts == 1) {
        c->set_output(0, c->MakeShape({c->Dim(x, 0), c->Dim(x, 2)}));
      } else {
        c->set_output(0, c->MakeShape({c->Dim(x, 0), c->Dim(x, 2), c->Dim(x, 3)}));
      }
      c->set_output(1, c->MakeShape({c->Dim(x, 0), c->Dim(x, 2)}));
      c->set_output(2, c->Scalar());
      return Status();
    });

template <typename T>
class StableMomentsOp : public OpKernel {
 public:
  explicit StableMomentsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int64_t ddof;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("ddof", &ddof));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("precision", &format_.precision));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("emin", &format_.emin));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("emax", &format_.emax));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("parts", &parts_));
    OP_REQUIRES(ctx, parts_ == 1 || parts_ == 2,
                tensorflow::errors::InvalidArgument("StableMoments: parts must be 1 or 2"));
    ddof_ = ddof;
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    OP_REQUIRES(ctx, x.dims() == (parts_ == 1 ? 3 : 4),
                tensorflow::errors::InvalidArgument("StableMoments: x has rank ", x.dims()));
    const int64_t outer = x.dim_size(0), n = x.dim_size(1), inner = x.dim_size(2);
    OP_REQUIRES(ctx, n < (int64_t(1) << 46),
                tensorflow::errors::InvalidArgument(
                    "moments: a slice of ", n, " elements exceeds the kernel's 2**46 limit"));
    TensorShape mean_shape({outer, inner});
    if (parts_ == 2) mean_shape.AddDim(2);
    Tensor* mean = nullptr;
    Tensor* var = nullptr;
    Tensor* undecided = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, mean_shape, &mean));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({outer, inner}), &var));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({}), &undecided));
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
    int threads = workers ? workers->num_threads : 1;
    stable_moments::Result r = stable_moments::moments<T>(
        x.flat<T>().data(), outer, n, inner, parts_, ddof_, format_, mean->flat<T>().data(),
        var->flat<T>().data(), threads);
    undecided->scalar<int64_t>()() = r.undecided;
  }

 private:
  stable_moments::Format format_;
  int64_t ddof_ = 0;
  int parts_ = 1;
};

REGISTER_KERNEL_BUILDER(
    Name("StableMoments").Device(DEVICE_CPU).TypeConstraint<float>("T"),
    StableMomentsOp<float>);
REGISTER_KERNEL_BUILDER(
    Name("StableMoments").Device(DEVICE_CPU).TypeConstraint<double>("T"),
    StableMomentsOp<double>);

}  // namespace
