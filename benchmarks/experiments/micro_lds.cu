// Shared-memory wavefronts of 128-bit loads for the fused MLP's access patterns (NOTES.md, log 11):
// pattern p maps lane t to a float4 index; ncu's wavefront count per LDS.128 gives the rule the
// kernel's thread map follows. On the GPU machine:
//   nvcc -O3 -arch=sm_90 benchmarks/micro_lds.cu -o /tmp/lds && ncu --clock-control none --metrics \
//     smsp__inst_executed_op_shared_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum /tmp/lds
#include <cstdio>
__device__ __forceinline__ int pat(int p, int t) {
  switch (p) {
    case 0: return 0;                 // uniform
    case 1: return t % 8;             // weights-like (og = t%8)
    case 2: return t / 8;             // activations-like (sg = t/8)
    case 3: return t;                 // 32 distinct
    case 4: return t % 4;
    case 5: return t / 16;
    case 6: return t % 16;
    case 7: return t / 4;
    case 8: return (t / 8) * 33;      // rows stride 33
    case 9: return (t % 8) * 4 * 33 + t / 8;   // hidden store pattern (og*4)*33 + sg
    case 10: return (t % 32) * 33;    // column
    case 11: return t % 2;
    case 12: return t / 2 % 2 + (t / 16) * 2; // 4 distinct, 2 per half
    default: return (t % 8) * 8;      // 8 distinct same bank group
  }
}
template <int P, bool ST>
__global__ void k(float4 *out, int n) {
  __shared__ float4 s[2048];
  int t = threadIdx.x;
  for (int i = t; i < 2048; i += blockDim.x) s[i] = make_float4(i, 1, 2, 3);
  __syncthreads();
  int a = pat(P, t % 32) + (t / 32) * 0;
  float4 acc = make_float4(0, 0, 0, 0);
  for (int r = 0; r < n; ++r) {
    if (ST) { s[(a + (r & 1) * 1024) & 2047] = acc; acc.x += 1.f; }
    else { float4 v = s[a & 2047]; acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w; a ^= (r & 1) << 10; }
  }
  out[blockIdx.x * blockDim.x + t] = acc;
}
template <int P> void run(float4 *o) { k<P, false><<<1, 32>>>(o, 1000); k<P, true><<<1, 32>>>(o, 1000); }
int main() {
  float4 *o; cudaMalloc(&o, 1 << 20);
  run<0>(o); run<1>(o); run<2>(o); run<3>(o); run<4>(o); run<5>(o); run<6>(o); run<7>(o);
  run<8>(o); run<9>(o); run<10>(o); run<11>(o); run<12>(o); run<13>(o);
  cudaDeviceSynchronize(); printf("done %s\n", cudaGetErrorString(cudaGetLastError()));
}
