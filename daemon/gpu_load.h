#pragma once
// `sparkd gpu-load --gpu N --ms M`: a short compute load on one GPU for preflight's
// gpu.throttle (sparkctl samples NVML while it runs): back-to-back 4096^3 bf16 products
// through the kernels library's Matmul (cuBLASLt), the shape that draws the most power.

namespace spark::daemon {

/// Runs the load; prints {"gpu", "iterations", "seconds", "tflops"} or {"error"} as one JSON
/// line. Exit 0, or the error's code (Errc::unsupported without CUDA or a GPU).
int gpu_load_main(int argc, const char* const* argv);

}  // namespace spark::daemon
