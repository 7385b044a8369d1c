// Shared-memory access patterns whose wavefronts are known in advance; the bank check runs this
// under Nsight Compute to prove that its per-instruction join (ncu's source counters, nvdisasm's
// line table, the `smem:` tags below) reads the hardware right before it judges a kernel.
// Each tagged line is one warp-wide access; the expected wavefronts per request are the model's
// (codegen/passes/banks.py, bench/bank_check.py PATTERNS).
#include <cstdio>
#include <cuda_runtime.h>

constexpr int ITERS = 64;

__global__ void patterns(float* out, int salt) {
  __shared__ __align__(16) float tile[32 * 33 + 64];
  __shared__ __align__(128) float swz[32 * 32];
  const int lane = threadIdx.x;
  for (int i = lane; i < 32 * 33 + 64; i += 32) tile[i] = i * 0.5f + salt;  // smem: init_rows
  for (int i = lane; i < 32 * 32; i += 32) swz[i] = i * 0.25f;  // smem: init_rows
  __syncwarp();
  float acc = 0.f;
  float4 acc4 = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
  for (int it = 0; it < ITERS; ++it) {
    const int col = (it + salt) & 31;
    acc += tile[lane * 32 + col];  // smem: column_stride32
    acc += tile[lane * 33 + col];  // smem: column_padded
    const float4 v = reinterpret_cast<const float4*>(tile)[lane + (col & 1)];  // smem: vector16
    acc4.x += v.x; acc4.y += v.y; acc4.z += v.z; acc4.w += v.w;
    const float4 s = reinterpret_cast<const float4*>(swz)[lane * 8 + ((col & 7) ^ (lane & 7))];  // smem: xor_swizzled
    acc4.x += s.x; acc4.y -= s.y; acc4.z += s.z; acc4.w -= s.w;
    const float4 u = reinterpret_cast<const float4*>(swz)[lane * 8 + (col & 7)];  // smem: unswizzled_rows
    acc4.x -= u.x; acc4.y += u.y;
    tile[lane * 32 + ((col + 1) & 31)] = acc;  // smem: column_store_stride32
    __syncwarp();
  }
  out[blockIdx.x * 32 + lane] = acc + acc4.x + acc4.y + acc4.z + acc4.w;
}

int main() {
  float* out;
  cudaMalloc(&out, 4 * 32 * sizeof(float));
  patterns<<<4, 32>>>(out, 3);
  const cudaError_t err = cudaDeviceSynchronize();
  std::printf("patterns: %s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
