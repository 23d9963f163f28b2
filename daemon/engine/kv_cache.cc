#include "daemon/engine/kv_cache.h"

#include <fmt/format.h>

namespace spark::engine {

KVCache::KVCache(int num_layers, int num_blocks, int block_size, int n_kv_heads, int head_dim) {
  auto cpu = make_cpu_device();
  auto c = create(*cpu, ElemType::f32, num_layers, num_blocks, block_size, n_kv_heads, head_dim);
  if (!c) throw std::bad_alloc();  // host allocation failure, as std::vector would throw
  *this = std::move(**c);
}

KVShape kv_shape(const ModelConfig& c, int local_kv_heads) {
  if (c.is_mla()) return {1, c.mla.cache_width(), 1};
  return {local_kv_heads, c.head_dim, 2};
}

Result<std::unique_ptr<KVCache>> KVCache::create(Device& device, ElemType type, int num_layers,
                                                 int num_blocks, int block_size, int n_kv_heads,
                                                 int head_dim) {
  return create(device, type, num_layers, num_blocks, block_size, KVShape{n_kv_heads, head_dim, 2});
}

Result<std::unique_ptr<KVCache>> KVCache::create(Device& device, ElemType type, int num_layers,
                                                 int num_blocks, int block_size,
                                                 const KVShape& shape,
                                                 const std::vector<bool>& windowed,
                                                 int window_blocks) {
  const int n_kv_heads = shape.n_kv_heads, head_dim = shape.head_dim;
  std::unique_ptr<KVCache> c(new KVCache());
  c->num_blocks_ = num_blocks;
  c->block_size_ = block_size;
  c->n_kv_heads_ = n_kv_heads;
  c->head_dim_ = head_dim;
  c->pools_ = shape.pools == 1 ? 1 : 2;
  c->type_ = type;
  c->device_kind_ = device.info().kind;
  if (window_blocks > 0) {
    c->window_blocks_ = window_blocks;
    c->windowed_ = windowed;
    c->windowed_.resize(static_cast<size_t>(num_layers), false);
  }
  const size_t per_block = static_cast<size_t>(block_size) * static_cast<size_t>(n_kv_heads) *
                           static_cast<size_t>(head_dim);
  size_t n = 0;
  c->offset_.resize(static_cast<size_t>(num_layers));
  for (int l = 0; l < num_layers; ++l) {
    c->offset_[static_cast<size_t>(l)] = n;
    n += per_block * static_cast<size_t>(c->windowed(l) ? window_blocks : num_blocks);
  }
  auto k = device.alloc(type, n);
  if (!k)
    return make_error(k.error().code,
                      fmt::format("KV cache: {} blocks ({} MiB of {} K) on {}: {}", num_blocks,
                                  (n * elem_size(type)) >> 20, elem_name(type), device.info().name,
                                  k.error().message));
  // Zeroed so that a padded attention read (a graph's unused batch rows) sees finite values.
  SPARK_TRY(device.zero(*k));
  c->k_ = std::move(*k);
  if (c->pools_ == 1) return c;  // latent attention: one row per token, no V
  auto v = device.alloc(type, n);
  if (!v)
    return make_error(v.error().code,
                      fmt::format("KV cache: {} blocks of {} V on {}: {}", num_blocks,
                                  elem_name(type), device.info().name, v.error().message));
  SPARK_TRY(device.zero(*v));
  c->v_ = std::move(*v);
  return c;
}

uint64_t KVCache::block_bytes(ElemType type, int num_layers, int block_size, int n_kv_heads,
                              int head_dim) {
  return block_bytes(type, num_layers, block_size, KVShape{n_kv_heads, head_dim, 2});
}

uint64_t KVCache::block_bytes(ElemType type, int num_layers, int block_size, const KVShape& s) {
  return static_cast<uint64_t>(s.pools == 1 ? 1 : 2) * static_cast<uint64_t>(num_layers) *
         static_cast<uint64_t>(block_size) * static_cast<uint64_t>(s.n_kv_heads) *
         static_cast<uint64_t>(s.head_dim) * elem_size(type);
}

KVLayerView KVCache::view(int l) const {
  KVLayerView p;
  const size_t off = offset_[static_cast<size_t>(l)] * elem_size(type_);
  p.k = static_cast<char*>(k_.data()) + off;
  p.v = v_.empty() ? nullptr : static_cast<char*>(v_.data()) + off;
  p.windowed = windowed(l);
  p.num_blocks = p.windowed ? window_blocks_ : num_blocks_;
  p.block_size = block_size_;
  p.n_kv_heads = n_kv_heads_;
  p.head_dim = head_dim_;
  p.type = type_;
  p.fp8_values = fp8_values_;
  return p;
}

kernels::PagedKVLayer KVCache::layer(int l) {
  const KVLayerView v = view(l);
  kernels::PagedKVLayer p;
  if (type_ != ElemType::f32 || device_kind_ != "cpu") return p;  // null pools: not host fp32
  p.k = static_cast<float*>(v.k);
  p.v = static_cast<float*>(v.v);  // null for a latent cache
  p.block_size = block_size_;
  p.n_kv_heads = n_kv_heads_;
  p.head_dim = head_dim_;
  return p;
}

}  // namespace spark::engine
