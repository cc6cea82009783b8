// Probe helpers (CUDA C++ with the device runtime): instantiate a captured CUDA graph for
// device launch, and a one-kernel host graph whose kernel tail-launches it, so a host
// launch of that small graph starts the step graph from the device.
// Built by scripts/probe_tail_launch.py: nvcc -O2 -arch=sm_90a -rdc=true -shared
// -Xcompiler -fPIC probe_tail_launch.cu -lcudadevrt -o libprobe_tail.so
#include <cuda_runtime.h>

__global__ void tail_kernel(cudaGraphExec_t exec) {
  cudaGraphLaunch(exec, cudaStreamGraphTailLaunch);
}

extern "C" {

int sg_instantiate(void* graph, unsigned long long flags, void** exec) {
  cudaGraphExec_t made;
  cudaError_t rc = cudaGraphInstantiateWithFlags(&made, (cudaGraph_t)graph, flags);
  if (rc != cudaSuccess) return rc;
  *exec = made;
  return 0;
}

int sg_upload(void* exec, void* stream) {
  return cudaGraphUpload((cudaGraphExec_t)exec, (cudaStream_t)stream);
}

int sg_launch(void* exec, void* stream) {
  return cudaGraphLaunch((cudaGraphExec_t)exec, (cudaStream_t)stream);
}

int sg_tail_host_graph(void* device_exec, void** host_exec) {
  cudaStream_t s;
  cudaError_t rc = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (rc != cudaSuccess) return rc;
  cudaGraph_t g;
  rc = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  if (rc != cudaSuccess) return rc;
  tail_kernel<<<1, 1, 0, s>>>((cudaGraphExec_t)device_exec);
  rc = cudaStreamEndCapture(s, &g);
  if (rc != cudaSuccess) return rc;
  cudaGraphExec_t made;
  rc = cudaGraphInstantiate(&made, g, 0);
  if (rc != cudaSuccess) return rc;
  *host_exec = made;
  cudaStreamDestroy(s);
  return 0;
}

const char* sg_error(int code) { return cudaGetErrorString((cudaError_t)code); }

int sg_sync() { return cudaDeviceSynchronize(); }
}
