#include "daemon/gpu_load.h"

#include <boost/program_options.hpp>
#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "kernels/cuda_runtime.h"
#include "kernels/cuda_stream.h"
#include "kernels/matmul.h"

namespace spark::daemon {

namespace po = boost::program_options;

namespace {

int fail(const Error& e) {
  std::cout << nlohmann::json{{"error", e.message}}.dump() << "\n";
  return exit_code(e.code);
}

// Device buffers freed on every path.
struct DeviceBuffers {
  std::vector<void*> p;
  ~DeviceBuffers() {
    for (void* x : p) kernels::cuda_free(x);
  }
};

}  // namespace

int gpu_load_main(int argc, const char* const* argv) {
  po::options_description desc("sparkd gpu-load options");
  desc.add_options()("gpu", po::value<int>()->default_value(0), "CUDA ordinal")(
      "ms", po::value<int>()->default_value(3000), "how long to load it");
  po::variables_map vm;
  try {
    po::store(po::parse_command_line(argc, argv, desc), vm);
    po::notify(vm);
  } catch (const std::exception& e) {
    return fail(make_error(Errc::usage, std::string("gpu-load: ") + e.what()));
  }
  const int gpu = vm["gpu"].as<int>();
  const auto budget = std::chrono::milliseconds(std::max(100, vm["ms"].as<int>()));
  if (!kernels::built_with_cuda())
    return fail(make_error(Errc::unsupported, "this sparkd was built without CUDA"));
  if (auto st = kernels::cuda_select_device(gpu); !st.ok()) return fail(st.error());
  auto mm = kernels::Matmul::create();
  if (!mm) return fail(mm.error());
  constexpr size_t kDim = 4096;
  constexpr size_t kBytes = kDim * kDim * 2;  // bf16
  DeviceBuffers buf;
  for (int i = 0; i < 3; ++i) {
    auto p = kernels::cuda_malloc(kBytes);
    if (!p) return fail(p.error());
    buf.p.push_back(*p);
  }
  auto stream = kernels::cuda_stream_create();
  if (!stream) return fail(stream.error());
  // Non-zero operands (0x3c3c is about 0.0115 in bf16): the power a product draws depends on
  // its data, and zeros draw less.
  for (int i = 0; i < 2; ++i)
    if (auto st = kernels::cuda_memset_async(buf.p[static_cast<size_t>(i)], 0x3c, kBytes, *stream);
        !st.ok())
      return fail(st.error());
  kernels::MatmulArgs a;
  a.a = buf.p[0];
  a.lda = kDim;
  a.w = buf.p[1];
  a.ldw = kDim;
  a.out = buf.p[2];
  a.ldo = kDim;
  a.m = a.n = a.k = kDim;
  a.backend = kernels::MatmulBackend::cublaslt;
  auto t0 = std::chrono::steady_clock::now();
  int64_t iters = 0;
  while (std::chrono::steady_clock::now() - t0 < budget) {
    for (int k = 0; k < 8; ++k) {
      if (auto st = mm->get()->run(a, *stream); !st.ok()) {
        kernels::cuda_stream_destroy(*stream);
        return fail(st.error());
      }
      ++iters;
    }
    if (auto st = kernels::cuda_stream_synchronize(*stream); !st.ok()) {
      kernels::cuda_stream_destroy(*stream);
      return fail(st.error());
    }
  }
  kernels::cuda_stream_destroy(*stream);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double tflops = 2.0 * kDim * kDim * kDim * static_cast<double>(iters) / secs / 1e12;
  std::cout << nlohmann::json{{"gpu", gpu},
                              {"iterations", iters},
                              {"seconds", secs},
                              {"tflops", tflops}}
                   .dump()
            << "\n";
  return 0;
}

}  // namespace spark::daemon
