#pragma once
// sparkctl version: this binary's version and build, plus what it finds on this node (CUDA
// driver, devices, NCCL). The fields sw.parity compares across nodes.
#include <nlohmann/json_fwd.hpp>
#include <ostream>
#include <string>

#include "env/gpu.h"

namespace spark::cli {

/// Everything `sparkctl version` reports.
struct VersionReport {
  std::string sparkctl;            // this build's version
  bool built_with_cuda = false;    // the kernels are compiled in
  std::string cuda_runtime;        // CUDA runtime linked in ("13.0"), empty without CUDA
  std::string cuda_architectures;  // "90,121"
  bool probed = false;             // false with --short
  env::GpuReport gpu;
  std::string engine_device;  // what the native engine's DEVICE=auto serves with here, and why
};

/// "cuda: GPU 0 (NVIDIA H200, sm_90)" or "cpu: <why not the GPU>", from the probe and the
/// architectures built (a GPU outside them is named with the rebuild to do).
std::string engine_device_for(const VersionReport& r);

/// Builds the report; probes the GPU with `opts` unless `probe` is false.
VersionReport collect_version(bool probe, const env::GpuProbeOptions& opts = {});
/// The report as JSON ({"sparkctl": "...", "build": {...}, "gpu": {...}}).
nlohmann::json to_json(const VersionReport& r);
/// The report as text, one fact per line; details (errors of single queries) with verbose.
void print_version(std::ostream& out, const VersionReport& r, int verbose);

}  // namespace spark::cli
