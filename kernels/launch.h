#pragma once
// Programmatic dependent launch (sm_90 and later): whether the decode kernels that support
// it are launched so that they may start while the kernel ahead of them in the stream
// finishes. Each such kernel waits (griddepcontrol.wait) before it touches anything the
// kernel ahead writes or reads; the matrix products first stream their weights, which no
// kernel of a step writes. Off by default; the CUDA engine turns it on at the start of each
// step (whose first kernel, the embedding, writes no weight) and off after an upload (a
// weight converted by the kernel just before a product would be read early).

namespace spark::kernels {

/// Per thread (the thread that launches, or captures a graph): launches after it changes
/// see it; a captured graph keeps what it was at capture.
void set_programmatic_launch(bool on);
bool programmatic_launch();

/// The pre-Hopper paths on any GPU (process-wide, off by default): thread-block clusters
/// and programmatic dependent launch are not used even where the GPU has them, so an sm_90
/// GPU runs the code an sm_80 one does (sparkd sets it from SPARK_CUDA_FALLBACKS=1; the
/// GPU tests set it to compare the two paths).
void set_cuda_fallbacks(bool on);
bool cuda_fallbacks();

}  // namespace spark::kernels
