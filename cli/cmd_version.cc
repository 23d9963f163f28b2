// sparkctl version [--short]
#include "cli/cmd_version.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <ostream>

#include "cli/args.h"
#include "core/strings.h"
#include "spark/version.h"

namespace spark::cli {

VersionReport collect_version(bool probe, const env::GpuProbeOptions& opts) {
  VersionReport r;
  r.sparkctl = kVersion;
  r.built_with_cuda = kBuiltWithCuda;
  r.cuda_runtime = kCudaRuntime;
  r.cuda_architectures = kCudaArchitectures;
  if (probe) {
    r.gpu = env::probe_gpu(opts);
    r.probed = true;
  }
  return r;
}

nlohmann::json to_json(const VersionReport& r) {
  nlohmann::json j = {{"sparkctl", r.sparkctl},
                      {"build",
                       {{"cuda", r.built_with_cuda},
                        {"cuda_runtime", r.cuda_runtime},
                        {"cuda_architectures", r.cuda_architectures}}}};
  if (r.probed) j["gpu"] = env::to_json(r.gpu);
  return j;
}

void print_version(std::ostream& out, const VersionReport& r, int verbose) {
  out << "sparkctl " << r.sparkctl << "\n";
  if (r.built_with_cuda)
    out << fmt::format("build: CUDA runtime {} (static), kernels for sm_{}\n", r.cuda_runtime,
                       join(split_list(r.cuda_architectures, ','), ", sm_"));
  else
    out << "build: without CUDA (CPU path only)\n";
  if (!r.probed) return;
  const auto& g = r.gpu;
  if (g.driver_loaded) {
    out << fmt::format(
        "CUDA driver: {}{} ({})\n", env::cuda_version_text(g.driver_api_version),
        g.kernel_module_version.empty() ? "" : ", kernel module " + g.kernel_module_version,
        g.driver_library);
  } else {
    out << "CUDA driver: " << g.driver_reason << "\n";
  }
  for (const auto& d : g.devices) {
    out << fmt::format(
        "GPU {}: {}, compute capability {}.{}, {} memory, {} KiB shared/block (opt-in), "
        "{} SMs{}\n",
        d.index, d.name.empty() ? "?" : d.name, d.cc_major, d.cc_minor, format_size(d.total_memory),
        d.max_smem_per_block_optin / 1024, d.multiprocessors,
        d.pci_bus_id.empty() ? "" : ", " + d.pci_bus_id);
    for (const auto& e : d.errors) out << "  query failed: " << e << "\n";
  }
  if (g.driver_loaded && !g.has_gpu()) out << "GPU: none usable: " << g.driver_reason << "\n";
  if (g.nccl_loaded)
    out << fmt::format("NCCL: {} ({})\n", env::nccl_version_text(g.nccl_version_code),
                       g.nccl_library);
  else
    out << "NCCL: " << g.nccl_reason << "\n";
  if (!g.holders.empty()) {
    for (const auto& h : g.holders)
      out << fmt::format("GPU held by pid {} ({}): {}\n", h.pid, h.comm, join(h.devices, ", "));
  } else if (verbose > 0) {
    out << "GPU held by: no other process\n";
  }
  if (verbose > 0 && g.holders_unreadable > 0)
    out << fmt::format(
        "GPU holders: {} process(es) could not be inspected (run as root to see all)\n",
        g.holders_unreadable);
}

int cmd_version(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("Options");
  desc.add_options()("short", "print only the version of sparkctl; do not probe the GPU");
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "version", "version [--short] [--json] [-v]", desc, args, vm))
    return *rc;
  VersionReport r = collect_version(vm.count("short") == 0);
  if (ctx.opts.json)
    *ctx.out << to_json(r).dump(2) << "\n";
  else
    print_version(*ctx.out, r, ctx.opts.verbose);
  return 0;
}

}  // namespace spark::cli
