// Shared-memory ring for one directed channel between two processes of one node (CPU tensors).
//
// The receiver creates the segment (it owns the K receive slots), the sender attaches and then
// unlinks the name at once: from that moment only the two mappings keep the memory alive, so a crash
// of either side leaves nothing in /dev/shm. Each slot carries the 128-byte wire header (opaque
// here) and up to slot_bytes of payload; the sender fills slots in ring order and waits for the next
// one to be EMPTY (a credit), the receiver takes them in the same order and may release them in any
// order (a consumer may hold a view of a slot until it is done with it).
//
// Ring waits never spin: futex waits on two sequence words (data_seq bumped by every commit,
// free_seq by every release), in slices of poll_s so the waiter can notice that its peer died
// (pid gone, zombie, or pid reused: start time changed) or closed its end.
//
// WordLog: one writer (TP rank 0 of a stage) publishes 64-bit words into numbered slots and bumps a
// futex word; readers (its TP peers) sleep on that word until the slot they want holds a word of the
// current step, checking the writer's pid between slices like the ring waits (trainer/pipeline/tp_decision.py).
//
// Deliberately no libtorch: raw pointers and bytes in, a buffer-protocol view out (docs/transport.md#transports).
#include <pybind11/pybind11.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <linux/futex.h>
#include <signal.h>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

namespace py = pybind11;

namespace {

constexpr uint64_t kMagic = 0x314D485350504D44ULL;  // "DMPPSHM1"
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 128;
constexpr size_t kPage = 4096;
// A slot goes EMPTY -> FULL (sender committed) -> HELD (receiver took it; a consumer may still
// view it) -> EMPTY (released). HELD keeps a wrapped-around receiver from re-reading a slot that is
// still full of an already-delivered message.
constexpr uint32_t kEmpty = 0, kFull = 1, kHeld = 2;

// Status codes returned by waits (non-negative values are slot indices).
constexpr int kTimeout = -1;
constexpr int kPeerDead = -2;
constexpr int kPeerClosed = -3;

struct alignas(64) Endpoint {
    std::atomic<int32_t> pid;
    std::atomic<uint32_t> closed;
    std::atomic<int64_t> start_time;  // /proc/<pid>/stat field 22: detects a reused pid
    std::atomic<uint64_t> pid_namespace;  // inode of /proc/self/ns/pid: pid checks need the same one
};

struct alignas(64) SeqWord {  // a futex word with a count of sleepers, on its own cache line
    std::atomic<uint32_t> seq;
    std::atomic<uint32_t> waiters;
};

struct alignas(64) Control {
    uint64_t magic;
    uint32_t version;
    uint32_t num_slots;
    uint64_t slot_bytes;
    uint64_t total_bytes;
    Endpoint receiver;
    Endpoint sender;
    SeqWord data;  // bumped on commit, close: the receiver sleeps on it
    SeqWord free;  // bumped on release, close: the sender sleeps on it
};

struct alignas(64) SlotMeta {
    std::atomic<uint32_t> state;
    uint32_t reserved;
    uint64_t nbytes;
    uint8_t header[kHeaderBytes];
};

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }
size_t meta_offset() { return round_up(sizeof(Control), 64); }
size_t data_offset(uint32_t num_slots) {
    return round_up(meta_offset() + num_slots * sizeof(SlotMeta), kPage);
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* timeout) {
    // Not FUTEX_PRIVATE_FLAG: the word lives in memory shared between processes.
    return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, timeout, nullptr, 0);
}

void wake(SeqWord& w) {
    w.seq.fetch_add(1, std::memory_order_seq_cst);
    if (w.waiters.load(std::memory_order_seq_cst) > 0) futex(&w.seq, FUTEX_WAKE, INT_MAX, nullptr);
}

// Start time of `pid` in clock ticks (field 22 of /proc/<pid>/stat); 0 if it is a zombie or gone,
// -1 if /proc cannot tell (then only kill(pid, 0) is used).
int64_t process_start_time(int pid) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    if (!stat) return kill(pid, 0) != 0 && errno == ESRCH ? 0 : -1;
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    auto close_paren = text.rfind(')');  // the command name may contain spaces and ')'
    if (close_paren == std::string::npos || close_paren + 2 >= text.size()) return -1;
    std::istringstream rest(text.substr(close_paren + 2));
    std::string field;
    for (int i = 3; i <= 22 && rest >> field; ++i) {
        if (i == 3 && (field == "Z" || field == "X")) return 0;  // zombie: dead, not yet reaped
        if (i == 22) return static_cast<int64_t>(std::stoull(field));
    }
    return -1;
}

uint64_t own_pid_namespace() {
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Spin this long before sleeping on a futex word (doorbell and word-log waits). On virtual machines
// (the GPU hosts here are Firecracker VMs) waking a thread whose vCPU halted costs ~75 us, paid on
// every message that arrives after the consumer fell asleep; most arrive within tens of microseconds
// of the consumer running dry (a neighbour finishing its op), so a 100 us spin picks them up without
// that round trip. An idle wait still sleeps after it: the core is busy at most 100 us per wait.
constexpr double kSpinS = 100e-6;

void publish_self(Endpoint& me) {
    me.pid_namespace.store(own_pid_namespace());
    me.start_time.store(process_start_time(getpid()));
    me.pid.store(getpid());
}

// False if the process behind `p` died: pid gone, zombie, or pid reused (start time changed). True
// while it may be alive, also when it cannot tell (not announced yet, or another pid namespace).
bool endpoint_alive(const Endpoint& p, bool same_namespace) {
    int pid = p.pid.load();
    if (pid == 0 || !same_namespace) return true;  // not attached yet / cannot tell
    if (kill(pid, 0) != 0 && errno == ESRCH) return false;
    int64_t recorded = p.start_time.load(), started = process_start_time(pid);
    if (started == 0) return false;                 // zombie
    if (started < 0 || recorded < 0) return true;   // /proc cannot tell: trust kill()
    return started == recorded;                     // a different start time: pid reused
}

// Sleep on `word` until ready() returns something other than kTimeout, alive() says the peer died
// (asked every poll_s), or the timeout passes. Called with the GIL released.
template <typename Alive, typename Ready>
auto sleep_until(SeqWord& word, double timeout_s, double poll_s, Alive alive, Ready ready) -> decltype(ready()) {
    double deadline = now_s() + timeout_s;
    double next_check = now_s() + poll_s;
    while (true) {
        uint32_t seen = word.seq.load(std::memory_order_seq_cst);
        auto rc = ready();
        if (rc != kTimeout) return rc;
        double now = now_s();
        if (now >= next_check) {
            if (!alive()) return kPeerDead;
            next_check = now + poll_s;
        }
        if (now >= deadline) return kTimeout;
        double slice = std::min(deadline - now, poll_s);
        timespec ts{static_cast<time_t>(slice), static_cast<long>((slice - static_cast<time_t>(slice)) * 1e9)};
        word.waiters.fetch_add(1, std::memory_order_seq_cst);
        if (ready() == kTimeout) futex(&word.seq, FUTEX_WAIT, seen, &ts);
        word.waiters.fetch_sub(1, std::memory_order_seq_cst);
    }
}

std::runtime_error os_error(const std::string& what, const std::string& name) {
    return std::runtime_error(what + " " + name + ": " + std::strerror(errno));
}

// Creates segment `name` (O_EXCL: a stale or foreign one is an error), mode 0600, `bytes` long, and
// returns its descriptor. fallocate, not ftruncate: reserve the pages now, so a full /dev/shm is an
// error here rather than a SIGBUS in the middle of a copy.
int create_segment(const std::string& name, size_t bytes) {
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) throw os_error("shm_open(create)", name);
    int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (rc != 0) {
        close(fd);
        shm_unlink(name.c_str());
        errno = rc;
        throw os_error("posix_fallocate(" + std::to_string(bytes) + " bytes)", name);
    }
    return fd;
}

// Opens existing segment `name` to attach to it and returns its descriptor and size; a segment
// shorter than `min_bytes` is not a `what` (closed, and an error naming both).
std::pair<int, size_t> open_segment(const std::string& name, size_t min_bytes, const std::string& what) {
    int fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) throw os_error("shm_open(attach)", name);
    struct stat st;
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < min_bytes) {
        close(fd);
        throw std::runtime_error("shared-memory segment " + name + " is not a " + what + " (too small)");
    }
    return {fd, static_cast<size_t>(st.st_size)};
}

// Maps `size` bytes of the segment behind `fd` and closes `fd` (the mapping keeps it alive).
// MAP_POPULATE: fault the page tables in now, not on the first copy of the hot path.
void* map_segment(int fd, size_t size, const std::string& name) {
    void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    int saved = errno;
    close(fd);
    if (base == MAP_FAILED) {
        errno = saved;
        throw os_error("mmap", name);
    }
    return base;
}

// One futex word per receiving rank that every sender into that rank bumps on each commit and close
// (and the rank's own receiver threads of other transports bump on each arrival), so the consumer
// thread can sleep on a single word for "anything arrived on any incoming channel" and then read the
// rings itself: no receiver thread, no hand-off between threads per message.
struct alignas(64) DoorbellPage {
    uint64_t magic;
    uint32_t version;
    uint32_t reserved;
    SeqWord bell;
};

class Doorbell {
  public:
    static Doorbell* create(const std::string& name) {
        Doorbell* d = new Doorbell(name, create_segment(name, kPage));
        d->page()->magic = kMagic;
        d->page()->version = kVersion;
        return d;
    }
    static Doorbell* attach(const std::string& name) {
        int fd = shm_open(name.c_str(), O_RDWR, 0600);
        if (fd < 0) throw os_error("shm_open(attach)", name);
        Doorbell* d = new Doorbell(name, fd);
        if (d->page()->magic != kMagic || d->page()->version != kVersion) {
            delete d;
            throw std::runtime_error("shared-memory segment " + name + " is not a doorbell");
        }
        return d;
    }
    ~Doorbell() {
        if (base_ != nullptr) munmap(base_, kPage);
    }
    uint32_t seq() const { return page()->bell.seq.load(std::memory_order_seq_cst); }
    void ring() { wake(page()->bell); }
    // Sleep until the word differs from `seen` (something arrived since the caller last looked) or
    // `timeout_s` passes. Returns true if it moved. A short spin first: a message that is already on
    // its way (the sender is mid-copy) is picked up without a sleep/wake-up round trip.
    bool wait(uint32_t seen, double timeout_s) {
        SeqWord& w = page()->bell;
        double spin_until = now_s() + std::min(timeout_s, kSpinS);
        do {
            if (w.seq.load(std::memory_order_seq_cst) != seen) return true;
        } while (now_s() < spin_until);
        if (timeout_s <= kSpinS) return false;
        double slice = timeout_s - kSpinS;
        timespec ts{static_cast<time_t>(slice), static_cast<long>((slice - static_cast<time_t>(slice)) * 1e9)};
        w.waiters.fetch_add(1, std::memory_order_seq_cst);
        if (w.seq.load(std::memory_order_seq_cst) == seen) futex(&w.seq, FUTEX_WAIT, seen, &ts);
        w.waiters.fetch_sub(1, std::memory_order_seq_cst);
        return w.seq.load(std::memory_order_seq_cst) != seen;
    }
    void unlink() {
        if (!unlinked_) {
            shm_unlink(name_.c_str());
            unlinked_ = true;
        }
    }
    SeqWord& word() { return page()->bell; }

  private:
    Doorbell(std::string name, int fd) : name_(std::move(name)), base_(map_segment(fd, kPage, name_)) {}
    DoorbellPage* page() const { return static_cast<DoorbellPage*>(base_); }

    std::string name_;
    void* base_ = nullptr;
    bool unlinked_ = false;
};

class Ring {
  public:
    // Receiver end: create and own the segment (O_EXCL: a stale or foreign one is an error).
    static Ring* create(const std::string& name, uint32_t num_slots, uint64_t slot_bytes) {
        if (num_slots == 0 || slot_bytes == 0 || slot_bytes % 64)
            throw std::invalid_argument("num_slots must be > 0 and slot_bytes a positive multiple of 64");
        size_t total = data_offset(num_slots) + num_slots * round_up(slot_bytes, kPage);
        Ring* ring = new Ring(name, create_segment(name, total), total, /*is_sender=*/false);
        Control* c = ring->control();
        c->magic = kMagic;
        c->version = kVersion;
        c->num_slots = num_slots;
        c->slot_bytes = slot_bytes;
        c->total_bytes = total;
        publish_self(c->receiver);
        return ring;
    }

    // Sender end: map an existing segment, announce ourselves, and unlink the name.
    static Ring* attach(const std::string& name) {
        auto [fd, size] = open_segment(name, sizeof(Control), "ring");
        Ring* ring = new Ring(name, fd, size, /*is_sender=*/true);
        Control* c = ring->control();
        if (c->magic != kMagic || c->version != kVersion || c->total_bytes != ring->size_) {
            delete ring;
            throw std::runtime_error("shared-memory segment " + name + " has a foreign layout");
        }
        publish_self(c->sender);
        wake(c->free);  // the receiver may be waiting for us to attach
        ring->unlink();
        return ring;
    }

    ~Ring() {
        if (base_ != nullptr) munmap(base_, size_);
    }

    // ---- common ------------------------------------------------------------------------------
    uint32_t num_slots() const { return control()->num_slots; }
    uint64_t slot_bytes() const { return control()->slot_bytes; }
    size_t total_bytes() const { return size_; }
    size_t slot_offset(uint32_t slot) const {
        check_slot(slot);
        return data_offset(num_slots()) + slot * round_up(slot_bytes(), kPage);
    }
    int peer_pid() const { return peer().pid.load(); }
    bool pid_checks_possible() const {
        return control()->sender.pid_namespace.load() == control()->receiver.pid_namespace.load();
    }
    void unlink() {
        if (!unlinked_) {
            shm_unlink(name_.c_str());  // ENOENT is fine: the other end got there first
            unlinked_ = true;
        }
    }
    void close_end() {  // tell the peer this end is gone (end of stream for a sender)
        Endpoint& me = is_sender_ ? control()->sender : control()->receiver;
        if (me.closed.exchange(1) == 0) {
            wake(control()->data);
            wake(control()->free);
            if (doorbell_ != nullptr) wake(*doorbell_);  // the receiving consumer sees end of stream
        }
    }
    uint8_t* data() const { return static_cast<uint8_t*>(base_); }

    // ---- receiver: wait for the sender to attach ------------------------------------------------
    int wait_attached(double timeout_s, double poll_s) {
        return wait_until(control()->free, timeout_s, poll_s, /*check_peer=*/false,
                          [&]() { return control()->sender.pid.load() != 0 ? 0 : kTimeout; });
    }

    // ---- sender ----------------------------------------------------------------------------------
    int acquire(double timeout_s, double poll_s) {
        uint32_t slot = static_cast<uint32_t>(head_ % num_slots());
        return wait_until(control()->free, timeout_s, poll_s, true, [&]() {
            if (control()->receiver.closed.load()) return kPeerClosed;
            return meta(slot).state.load(std::memory_order_acquire) == kEmpty ? static_cast<int>(slot) : kTimeout;
        });
    }
    void write(uint32_t slot, uint64_t offset, uintptr_t src, uint64_t nbytes) {
        if (offset + nbytes > slot_bytes()) throw std::out_of_range("write past the end of a slot");
        std::memcpy(data() + slot_offset(slot) + offset, reinterpret_cast<const void*>(src), nbytes);
    }
    // `external`: the payload lives outside this ring (CUDA IPC slots on the receiver's GPU, of
    // their own size); the ring then carries only the header and the byte count.
    void commit(uint32_t slot, uint64_t nbytes, const std::string& header, bool external) {
        if (slot != head_ % num_slots()) throw std::logic_error("commit of a slot that was not acquired");
        if ((!external && nbytes > slot_bytes()) || header.size() != kHeaderBytes)
            throw std::invalid_argument("commit: payload larger than a slot or header not 128 bytes");
        SlotMeta& m = meta(slot);
        m.nbytes = nbytes;
        std::memcpy(m.header, header.data(), kHeaderBytes);
        m.state.store(kFull, std::memory_order_release);
        ++head_;
        wake(control()->data);
        if (doorbell_ != nullptr) wake(*doorbell_);
    }
    // Sender: also ring the receiving rank's doorbell on every commit and on close. The Python
    // binding keeps `bell` alive as long as this ring.
    void set_doorbell(Doorbell& bell) { doorbell_ = &bell.word(); }

    // ---- receiver --------------------------------------------------------------------------------
    int wait_full(double timeout_s, double poll_s) {
        uint32_t slot = static_cast<uint32_t>(tail_ % num_slots());
        int rc = wait_until(control()->data, timeout_s, poll_s, true, [&]() {
            if (meta(slot).state.load(std::memory_order_acquire) == kFull) return static_cast<int>(slot);
            // The sender marks closed only after its last commit, so an empty slot now means EOF;
            // our own close() also ends the wait (a thread blocked here must be able to stop).
            return control()->sender.closed.load() || control()->receiver.closed.load() ? kPeerClosed : kTimeout;
        });
        if (rc >= 0) {
            meta(slot).state.store(kHeld, std::memory_order_relaxed);
            ++tail_;
        }
        return rc;
    }
    uint64_t slot_nbytes(uint32_t slot) const { return meta(slot).nbytes; }
    py::bytes slot_header(uint32_t slot) const {
        return py::bytes(reinterpret_cast<const char*>(meta(slot).header), kHeaderBytes);
    }
    void read(uint32_t slot, uint64_t offset, uintptr_t dst, uint64_t nbytes) const {
        if (offset + nbytes > slot_bytes()) throw std::out_of_range("read past the end of a slot");
        std::memcpy(reinterpret_cast<void*>(dst), data() + slot_offset(slot) + offset, nbytes);
    }
    void release(uint32_t slot) {
        if (meta(slot).state.load() != kHeld) throw std::logic_error("release of a slot that is not held");
        meta(slot).state.store(kEmpty, std::memory_order_release);
        wake(control()->free);
    }

    // Receiver: 0 if the sender may still be alive, kPeerDead if it died (same test as the waits).
    int peer_status() const { return peer_alive() ? 0 : kPeerDead; }

  private:
    Ring(std::string name, int fd, size_t size, bool is_sender)
        : name_(std::move(name)), base_(map_segment(fd, size, name_)), size_(size), is_sender_(is_sender) {}

    Control* control() const { return static_cast<Control*>(base_); }
    const Endpoint& peer() const { return is_sender_ ? control()->receiver : control()->sender; }
    SlotMeta& meta(uint32_t slot) const {
        check_slot(slot);
        return reinterpret_cast<SlotMeta*>(data() + meta_offset())[slot];
    }
    void check_slot(uint32_t slot) const {
        if (slot >= num_slots()) throw std::out_of_range("slot index out of range");
    }
    bool peer_alive() const { return endpoint_alive(peer(), pid_checks_possible()); }

    template <typename Ready>
    int wait_until(SeqWord& word, double timeout_s, double poll_s, bool check_peer, Ready ready) {
        return sleep_until(word, timeout_s, poll_s, [&]() { return !check_peer || peer_alive(); }, ready);
    }

    std::string name_;
    void* base_ = nullptr;
    size_t size_ = 0;
    bool is_sender_ = false;
    bool unlinked_ = false;
    uint64_t head_ = 0;  // sender: messages committed
    uint64_t tail_ = 0;  // receiver: messages taken
    SeqWord* doorbell_ = nullptr;  // sender: the receiving rank's doorbell, if any
};

// One writer publishes 64-bit words into `capacity` numbered slots; readers wait for slot i to hold
// a word whose bits from `shift` up equal `tag` (trainer/pipeline/tp_decision.py: the step's
// generation). Each slot is one aligned 8-byte atomic, so a reader sees a whole word or the old one.
// The writer creates the segment and records its pid and rank; every publish bumps `bell`, the
// futex word the readers sleep on after a short spin.
struct alignas(64) WordLogControl {
    uint64_t magic;
    uint32_t version;
    uint32_t capacity;
    int64_t writer_rank;
    Endpoint writer;
    SeqWord bell;
};

class WordLog {
  public:
    static WordLog* create(const std::string& name, uint32_t capacity, int64_t writer_rank) {
        if (capacity == 0) throw std::invalid_argument("capacity must be > 0");
        size_t size = round_up(words_offset() + capacity * sizeof(uint64_t), kPage);
        WordLog* log = new WordLog(name, create_segment(name, size), size);
        WordLogControl* c = log->control();  // fallocate'd pages are zero: no slot holds a tag yet
        c->magic = kMagic;
        c->version = kVersion;
        c->capacity = capacity;
        c->writer_rank = writer_rank;
        publish_self(c->writer);
        return log;
    }
    static WordLog* attach(const std::string& name) {
        auto [fd, size] = open_segment(name, words_offset(), "word log");
        WordLog* log = new WordLog(name, fd, size);
        WordLogControl* c = log->control();
        if (c->magic != kMagic || c->version != kVersion || words_offset() + c->capacity * sizeof(uint64_t) > log->size_) {
            delete log;
            throw std::runtime_error("shared-memory segment " + name + " is not a word log");
        }
        return log;
    }
    ~WordLog() {
        if (base_ != nullptr) munmap(base_, size_);
    }

    uint32_t capacity() const { return control()->capacity; }
    int64_t writer_rank() const { return control()->writer_rank; }
    int writer_pid() const { return control()->writer.pid.load(); }
    bool pid_checks_possible() const { return control()->writer.pid_namespace.load() == own_pid_namespace(); }
    void unlink() {
        if (!unlinked_) {
            shm_unlink(name_.c_str());
            unlinked_ = true;
        }
    }

    uint64_t load(uint32_t index) const { return slot(index).load(std::memory_order_acquire); }
    void publish(uint32_t index, uint64_t word) {
        slot(index).store(word, std::memory_order_release);
        wake(control()->bell);
    }
    // The word in slot `index` once its bits from `shift` up equal `tag` (spin kSpinS, then sleep on
    // the bell in slices of poll_s with a writer pid check between them); else TIMEOUT or PEER_DEAD.
    // Words must fit in 63 bits: the status codes are negative.
    int64_t wait_tag(uint32_t index, uint64_t tag, uint32_t shift, double timeout_s, double poll_s) {
        std::atomic<uint64_t>& w = slot(index);
        auto ready = [&]() -> int64_t {
            uint64_t word = w.load(std::memory_order_acquire);
            return (word >> shift) == tag ? static_cast<int64_t>(word) : kTimeout;
        };
        double start = now_s(), spin_until = start + std::min(timeout_s, kSpinS);
        do {
            int64_t rc = ready();
            if (rc != kTimeout) return rc;
        } while (now_s() < spin_until);
        bool same_namespace = pid_checks_possible();
        return sleep_until(control()->bell, std::max(0.0, timeout_s - (now_s() - start)), poll_s,
                           [&]() { return endpoint_alive(control()->writer, same_namespace); }, ready);
    }

  private:
    WordLog(std::string name, int fd, size_t size) : name_(std::move(name)), base_(map_segment(fd, size, name_)), size_(size) {}
    static size_t words_offset() { return round_up(sizeof(WordLogControl), 64); }
    WordLogControl* control() const { return static_cast<WordLogControl*>(base_); }
    std::atomic<uint64_t>& slot(uint32_t index) const {
        if (index >= capacity()) throw std::out_of_range("word log index out of range");
        return reinterpret_cast<std::atomic<uint64_t>*>(static_cast<uint8_t*>(base_) + words_offset())[index];
    }

    std::string name_;
    void* base_ = nullptr;
    size_t size_ = 0;
    bool unlinked_ = false;
};

}  // namespace

PYBIND11_MODULE(_shm_ring, m) {
    m.doc() = "POSIX shared-memory ring buffers for MegatronDPP's stage-to-stage transport";
    m.attr("ABI_VERSION") = 4;
    m.attr("HEADER_BYTES") = kHeaderBytes;
    m.attr("TIMEOUT") = kTimeout;
    m.attr("PEER_DEAD") = kPeerDead;
    m.attr("PEER_CLOSED") = kPeerClosed;
    using gil = py::call_guard<py::gil_scoped_release>;
    py::class_<Doorbell>(m, "Doorbell")
        .def_static("create", &Doorbell::create, py::arg("name"), "Receiving rank: create (mode 0600).")
        .def_static("attach", &Doorbell::attach, py::arg("name"), "Sender: map an existing doorbell.")
        .def_property_readonly("seq", &Doorbell::seq)
        .def("ring", &Doorbell::ring)
        .def("wait", &Doorbell::wait, py::arg("seen"), py::arg("timeout_s"), gil(),
             "Sleep until seq != seen or the timeout passes; True if it moved.")
        .def("unlink", &Doorbell::unlink);
    py::class_<WordLog>(m, "WordLog")
        .def_static("create", &WordLog::create, py::arg("name"), py::arg("capacity"), py::arg("writer_rank"),
                    "Writer: create (mode 0600, zeroed) and record this process as the writer.")
        .def_static("attach", &WordLog::attach, py::arg("name"), "Reader: map an existing word log.")
        .def_property_readonly("capacity", &WordLog::capacity)
        .def_property_readonly("writer_rank", &WordLog::writer_rank)
        .def_property_readonly("writer_pid", &WordLog::writer_pid)
        .def_property_readonly("pid_checks_possible", &WordLog::pid_checks_possible)
        .def("load", &WordLog::load, py::arg("index"))
        .def("publish", &WordLog::publish, py::arg("index"), py::arg("word"))
        .def("wait_tag", &WordLog::wait_tag, py::arg("index"), py::arg("tag"), py::arg("shift"),
             py::arg("timeout_s"), py::arg("poll_s"), gil(),
             "The word of slot index once word >> shift == tag; TIMEOUT or PEER_DEAD (the writer died).")
        .def("unlink", &WordLog::unlink);
    py::class_<Ring>(m, "Ring", py::buffer_protocol())
        .def_static("create", &Ring::create, py::arg("name"), py::arg("num_slots"), py::arg("slot_bytes"),
                    "Receiver end: create the segment (mode 0600, pages reserved).")
        .def_static("attach", &Ring::attach, py::arg("name"),
                    "Sender end: map the segment and unlink its name.")
        .def_property_readonly("num_slots", &Ring::num_slots)
        .def_property_readonly("slot_bytes", &Ring::slot_bytes)
        .def_property_readonly("total_bytes", &Ring::total_bytes)
        .def_property_readonly("peer_pid", &Ring::peer_pid)
        .def_property_readonly("pid_checks_possible", &Ring::pid_checks_possible)
        .def("slot_offset", &Ring::slot_offset)
        .def("unlink", &Ring::unlink)
        .def("close", &Ring::close_end)
        .def("wait_attached", &Ring::wait_attached, gil())
        .def("acquire", &Ring::acquire, gil())
        .def("write", &Ring::write, gil())
        .def("commit", &Ring::commit, py::arg("slot"), py::arg("nbytes"), py::arg("header"),
             py::arg("external") = false)
        .def("wait_full", &Ring::wait_full, gil())
        .def("poll_full", [](Ring& r) { return r.wait_full(0.0, 1.0); },
             "Receiver: the next full slot now, else TIMEOUT (PEER_CLOSED at end of stream); no wait.")
        .def("peer_status", &Ring::peer_status)
        .def("set_doorbell", &Ring::set_doorbell, py::keep_alive<1, 2>())
        .def("slot_nbytes", &Ring::slot_nbytes)
        .def("slot_header", &Ring::slot_header)
        .def("read", &Ring::read, gil())
        .def("release", &Ring::release)
        .def_buffer([](Ring& r) -> py::buffer_info {
            // The whole mapping as writable bytes; views keep the Ring (and so the mapping) alive.
            return py::buffer_info(r.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                                   {static_cast<py::ssize_t>(r.total_bytes())}, {1}, false);
        });
}
