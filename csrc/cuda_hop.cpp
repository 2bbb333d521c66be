// The host side of one same-node GPU hop in as few crossings as possible (issue 11).
//
// A send into a peer's CUDA IPC slot is four stream operations: order the side stream after the
// producer's stream (event record + wait), wait for "slot freed" (a 32-bit flag the consumer's
// stream writes), the device-to-device copy, and "slot filled" (a flag write into the peer's memory).
// Issued from Python through torch and ctypes this cost ~90-120 us of host time per send on the
// Firecracker GPU hosts (scripts/device/hop_profile.py: a torch stream context alone was 10 us, a
// one-line slice 3 us, a copy_ 7 us); here it is one call with the GIL released.
//
// No CUDA headers and no link against libcuda: the driver is opened with dlopen on first use (the
// symbols torch already loaded), so the extension builds and imports on machines without a GPU,
// where `available()` says why it cannot be used. Streams, events and addresses are the raw handles
// torch exposes (`Stream.cuda_stream`, `Event.cuda_event`, `Tensor.data_ptr()`), plus the device's
// primary context (`primary_context`): each call makes it current for its duration and restores the
// thread's previous one, because a sending thread need not have the channel's device current (a torch
// stream context used to do that, at 10 us a send).
#include <dlfcn.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace {

using CUresult = int;
using CUstream = void*;
using CUevent = void*;
using CUdeviceptr = unsigned long long;
using CUcontext = void*;
using CUdevice = int;

constexpr unsigned kWaitGeq = 0x0;        // CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0
constexpr unsigned kWriteDefault = 0x0;   // CU_STREAM_WRITE_VALUE_DEFAULT: memory barrier before the write

struct Driver {
    CUresult (*memcpy_dtod_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
    CUresult (*wait_value32)(CUstream, CUdeviceptr, uint32_t, unsigned) = nullptr;
    CUresult (*write_value32)(CUstream, CUdeviceptr, uint32_t, unsigned) = nullptr;
    CUresult (*event_record)(CUevent, CUstream) = nullptr;
    CUresult (*stream_wait_event)(CUstream, CUevent, unsigned) = nullptr;
    CUresult (*error_name)(CUresult, const char**) = nullptr;
    CUresult (*ctx_get_current)(CUcontext*) = nullptr;
    CUresult (*ctx_set_current)(CUcontext) = nullptr;
    CUresult (*device_get)(CUdevice*, int) = nullptr;
    CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
    std::string problem;  // empty when every symbol resolved
};

template <typename F>
bool resolve(void* lib, F& out, const char* name, const char* fallback = nullptr) {
    void* sym = dlsym(lib, name);
    if (sym == nullptr && fallback != nullptr) sym = dlsym(lib, fallback);
    out = reinterpret_cast<F>(sym);
    return sym != nullptr;
}

const Driver& driver() {
    static Driver d;
    static std::once_flag once;
    std::call_once(once, [] {
        void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);  // the one torch loaded, if any
        if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
        if (lib == nullptr) {
            const char* err = dlerror();
            d.problem = std::string("libcuda.so.1 not found: ") + (err ? err : "dlopen failed");
            return;
        }
        // CUDA >= 11.7 maps the stream memory operations to their _v2 ABI; older drivers have only
        // the original symbols. cuMemcpyDtoDAsync has been _v2 since CUDA 3.2.
        bool ok = resolve(lib, d.memcpy_dtod_async, "cuMemcpyDtoDAsync_v2") &&
                  resolve(lib, d.wait_value32, "cuStreamWaitValue32_v2", "cuStreamWaitValue32") &&
                  resolve(lib, d.write_value32, "cuStreamWriteValue32_v2", "cuStreamWriteValue32") &&
                  resolve(lib, d.event_record, "cuEventRecord") &&
                  resolve(lib, d.stream_wait_event, "cuStreamWaitEvent") &&
                  resolve(lib, d.error_name, "cuGetErrorName") &&
                  resolve(lib, d.ctx_get_current, "cuCtxGetCurrent") &&
                  resolve(lib, d.ctx_set_current, "cuCtxSetCurrent") &&
                  resolve(lib, d.device_get, "cuDeviceGet") &&
                  resolve(lib, d.primary_ctx_retain, "cuDevicePrimaryCtxRetain");
        if (!ok) d.problem = "libcuda.so.1 lacks a driver function this module needs";
    });
    return d;
}

const Driver& usable() {
    const Driver& d = driver();
    if (!d.problem.empty()) throw std::runtime_error(d.problem);
    return d;
}

void check(const Driver& d, CUresult rc, const char* what) {
    if (rc == 0) return;
    const char* name = nullptr;
    if (d.error_name == nullptr || d.error_name(rc, &name) != 0 || name == nullptr) name = "unknown error";
    throw std::runtime_error(std::string(what) + " failed: " + name + " (" + std::to_string(rc) + ")");
}

CUstream stream_of(uintptr_t handle) { return reinterpret_cast<CUstream>(handle); }

// `context` current on this thread for the guard's lifetime; the previous one is restored after.
class InContext {
  public:
    InContext(const Driver& d, uintptr_t context) : d_(d), want_(reinterpret_cast<CUcontext>(context)) {
        check(d_, d_.ctx_get_current(&previous_), "cuCtxGetCurrent");
        if (previous_ != want_) check(d_, d_.ctx_set_current(want_), "cuCtxSetCurrent");
    }
    ~InContext() {
        if (previous_ != want_) d_.ctx_set_current(previous_);
    }
    InContext(const InContext&) = delete;
    InContext& operator=(const InContext&) = delete;

  private:
    const Driver& d_;
    CUcontext want_;
    CUcontext previous_ = nullptr;
};

uintptr_t primary_context(int ordinal) {
    const Driver& d = usable();
    CUdevice dev = 0;
    CUcontext ctx = nullptr;
    check(d, d.device_get(&dev, ordinal), "cuDeviceGet");
    check(d, d.primary_ctx_retain(&ctx, dev), "cuDevicePrimaryCtxRetain");  // held for the process's life
    return reinterpret_cast<uintptr_t>(ctx);
}

// The single stream operations, each with its error check (the context is the caller's business).
void record_event(const Driver& d, uintptr_t event, uintptr_t stream) {
    check(d, d.event_record(reinterpret_cast<CUevent>(event), stream_of(stream)), "cuEventRecord");
}

void wait_event(const Driver& d, uintptr_t stream, uintptr_t event) {
    check(d, d.stream_wait_event(stream_of(stream), reinterpret_cast<CUevent>(event), 0), "cuStreamWaitEvent");
}

void wait_flag(const Driver& d, uintptr_t stream, uintptr_t addr, uint64_t value) {
    check(d, d.wait_value32(stream_of(stream), addr, static_cast<uint32_t>(value), kWaitGeq), "cuStreamWaitValue32");
}

void write_flag(const Driver& d, uintptr_t stream, uintptr_t addr, uint64_t value) {
    check(d, d.write_value32(stream_of(stream), addr, static_cast<uint32_t>(value), kWriteDefault),
          "cuStreamWriteValue32");
}

void copy_bytes(const Driver& d, uintptr_t stream, uintptr_t dst, uintptr_t src, uint64_t nbytes) {
    if (nbytes != 0) check(d, d.memcpy_dtod_async(dst, src, nbytes, stream_of(stream)), "cuMemcpyDtoDAsync");
}

// The whole send of one chunk on `stream`: after the producer's work (event `order` recorded on
// `producer`, skipped when `order` is 0), after the consumer freed the slot (flag at `wait_addr`
// >= `wait_value`; skipped when `wait_addr` is 0 or `wait_value` is 0, the slot's first fill), copy
// `nbytes` from `src` to `dst`, then write `signal_value` to the flag at `signal_addr` (skipped
// when 0). Flags are 32-bit; counts wrap like the driver's comparison does.
void flagged_copy(const Driver& d, uintptr_t stream, uintptr_t order, uintptr_t producer, uintptr_t wait_addr,
                  uint64_t wait_value, uintptr_t dst, uintptr_t src, uint64_t nbytes, uintptr_t signal_addr,
                  uint64_t signal_value) {
    if (order != 0) {
        record_event(d, order, producer);
        wait_event(d, stream, order);
    }
    if (wait_addr != 0 && wait_value != 0) wait_flag(d, stream, wait_addr, wait_value);
    copy_bytes(d, stream, dst, src, nbytes);
    if (signal_addr != 0) write_flag(d, stream, signal_addr, signal_value);
}

// What Python calls: `Op` with the driver checked and `context` current for the call's duration.
template <auto Op, typename... Args>
void in_context(uintptr_t context, Args... args) {
    const Driver& d = usable();
    InContext in(d, context);
    Op(d, args...);
}

}  // namespace

PYBIND11_MODULE(_cuda_hop, m) {
    m.doc() = "One same-node GPU hop (order, wait, copy, signal) per call, through the CUDA driver.";
    using release = py::call_guard<py::gil_scoped_release>;  // a full launch queue may block the call
    m.def("available", [] { return driver().problem; },
          "'' if the CUDA driver functions resolved, else why not");
    m.def("primary_context", &primary_context, py::arg("ordinal"),
          "the primary context of device `ordinal` (retained), for the calls below");
    m.def("flagged_copy",
          &in_context<flagged_copy, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uint64_t, uintptr_t, uintptr_t,
                      uint64_t, uintptr_t, uint64_t>,
          release(), py::arg("context"), py::arg("stream"), py::arg("order"), py::arg("producer"),
          py::arg("wait_addr"), py::arg("wait_value"), py::arg("dst"), py::arg("src"), py::arg("nbytes"),
          py::arg("signal_addr"), py::arg("signal_value"));
    m.def("wait_geq", &in_context<wait_flag, uintptr_t, uintptr_t, uint64_t>, release(), py::arg("context"),
          py::arg("stream"), py::arg("addr"), py::arg("value"),
          "queue on `stream`: wait until the 32-bit flag at `addr` >= `value` (wrapping compare)");
    m.def("write", &in_context<write_flag, uintptr_t, uintptr_t, uint64_t>, release(), py::arg("context"),
          py::arg("stream"), py::arg("addr"), py::arg("value"),
          "queue on `stream`: write `value` to the 32-bit flag at `addr` (after a memory barrier)");
    m.def("copy", &in_context<copy_bytes, uintptr_t, uintptr_t, uintptr_t, uint64_t>, release(),
          py::arg("context"), py::arg("stream"), py::arg("dst"), py::arg("src"), py::arg("nbytes"),
          "queue on `stream`: device-to-device copy of `nbytes`");
    m.def("record_event", &in_context<record_event, uintptr_t, uintptr_t>, release(), py::arg("context"),
          py::arg("event"), py::arg("stream"));
    m.def("wait_event", &in_context<wait_event, uintptr_t, uintptr_t>, release(), py::arg("context"),
          py::arg("stream"), py::arg("event"));
}
