//! A persistent thread pool for the forward pass. Each `run` hands the same closure
//! to every thread with its index; `run_dynamic` hands out numbered units of work
//! to whichever thread is free.
//!
//! Tuned for decode, where one token issues hundreds of short matvecs: workers spin
//! briefly on an epoch counter before parking on a condvar, and dispatch takes no lock
//! unless a worker is parked. `run` allocates nothing.
//!
//! A dispatch is a gate that workers enter before they read its closure. `run`
//! waits for every worker to have run it. `run_dynamic` does not wait for a
//! worker that has not arrived: once every unit is taken it closes the gate, so
//! a worker that the OS has not scheduled yet (another process on its core)
//! skips that dispatch instead of holding up the caller until it gets the core
//! (measured: Gemma 3 decode on 2 threads of a 2-core machine kept busy by a
//! compiler fell to 14 t/s from 49 on 1 thread).

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Spin iterations before a worker parks; ~tens of microseconds, longer than the
/// gap between two matmuls of one decode step.
const SPIN_ITERS: u32 = 20_000;
/// Spin iterations of `run`'s wait for the workers before it starts yielding its
/// time slice: when the machine has more runnable threads than cores, a worker
/// may be waiting for this core, and spinning on would only delay it.
const WAIT_SPINS_BEFORE_YIELD: u32 = 2_000;

type Job = dyn Fn(usize) + Sync;

/// [`Shared::gate`]: the epoch's low 32 bits, a closed bit, and the number of
/// workers inside the epoch's closure.
const GATE_EPOCH_SHIFT: u32 = 32;
const GATE_CLOSED: u64 = 1 << 31;
const GATE_INSIDE: u64 = GATE_CLOSED - 1;

struct Shared {
    epoch: AtomicU64,
    /// The job of the current epoch. Written only while the gate is closed and
    /// empty (or before the first epoch), so no worker reads it then.
    job: UnsafeCell<Option<*const Job>>,
    /// Who may read `job`: a worker enters (counts itself inside) only while the
    /// gate names the epoch it observed and is open.
    gate: AtomicU64,
    /// Workers that have run the current epoch's closure (what `run` waits for).
    pending: AtomicUsize,
    sleepers: AtomicUsize,
    shutdown: AtomicBool,
    panicked: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written by `dispatch` only while the gate is closed with no
// worker inside (the previous epoch's waits saw that, Acquire), before the new
// epoch's open gate is published (Release); workers read it only after entering
// that gate (a compare-exchange, Acquire). The pointee is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serializes concurrent `run` calls from different threads.
    run_lock: Mutex<()>,
}

impl ThreadPool {
    /// A pool of `n_threads` threads in total: the caller of `run` is thread 0.
    pub fn new(n_threads: usize) -> Self {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            gate: AtomicU64::new(GATE_CLOSED),
            pending: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..n_threads)
            .map(|idx| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("ds4-worker-{idx}"))
                    .spawn(move || worker(&shared, idx))
                    .expect("spawning a pool thread")
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            run_lock: Mutex::new(()),
        }
    }

    pub fn n_threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Calls `f(i)` once on each thread `i` in `0..n_threads()` and returns when all
    /// calls have returned. Panics if any call panicked.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.workers.is_empty() {
            f(0);
            return;
        }
        self.dispatch(f, true);
    }

    /// Publishes `f` as a new epoch, runs `f(0)` here, then waits: with
    /// `every_thread` until each worker has run `f`, otherwise only for the
    /// workers already inside it (the gate is closed first, so the others skip
    /// it). Panics if any call panicked.
    fn dispatch(&self, f: &(dyn Fn(usize) + Sync), every_thread: bool) {
        let _guard = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY: erase the lifetime of `f`; we do not return before every worker
        // that entered the gate has finished with it and the gate is closed to
        // the rest, so it outlives all uses.
        let job: *const Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &Job>(f) };
        // SAFETY: no worker reads `job` now: the previous epoch's gate is closed
        // and empty (checked by its wait, or never opened).
        unsafe { *s.job.get() = Some(job) };
        s.pending.store(self.workers.len(), Ordering::Relaxed);
        let epoch = s.epoch.load(Ordering::Relaxed) + 1;
        s.gate
            .store((epoch & 0xFFFF_FFFF) << GATE_EPOCH_SHIFT, Ordering::Release);
        s.epoch.store(epoch, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let main_result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(0)));
        if every_thread {
            wait_until(|| s.pending.load(Ordering::Acquire) == 0);
        }
        s.gate.fetch_or(GATE_CLOSED, Ordering::AcqRel);
        wait_until(|| s.gate.load(Ordering::Acquire) & GATE_INSIDE == 0);
        if let Err(p) = main_result {
            std::panic::resume_unwind(p);
        }
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a thread-pool worker panicked");
        }
    }

    /// Calls `f(unit)` once for every unit in `0..n_units`, each thread taking the
    /// next unit from a shared counter whenever it is free. Units of uneven cost, or
    /// a thread the OS (or a hypervisor) delays, then leave no other thread idle
    /// where a fixed split would wait for the slowest share.
    pub fn run_dynamic(&self, n_units: usize, f: &(dyn Fn(usize) + Sync)) {
        if self.workers.is_empty() || n_units <= 1 {
            (0..n_units).for_each(f);
            return;
        }
        let next = AtomicUsize::new(0);
        self.dispatch(
            &|_| loop {
                let unit = next.fetch_add(1, Ordering::Relaxed);
                if unit >= n_units {
                    break;
                }
                f(unit);
            },
            false,
        );
    }

    /// Splits `data` into chunks of `chunk_len` and calls `f(chunk_index, chunk)` for
    /// each, every thread taking the next chunk when it is free ([`Self::run_dynamic`]).
    pub fn for_each_chunk_mut<T: Send>(
        &self,
        data: &mut [T],
        chunk_len: usize,
        f: &(dyn Fn(usize, &mut [T]) + Sync),
    ) {
        assert!(
            chunk_len > 0 && data.len().is_multiple_of(chunk_len),
            "chunking"
        );
        self.for_each_block_mut(data, chunk_len, f);
    }

    /// Calls `f(first_row, rows)` over `data` cut into rows of `row_len`, handed
    /// out in blocks of whole rows ([`ROW_BLOCKS_PER_THREAD`] blocks per thread, the
    /// last one possibly shorter). A batch too small to repay a dispatch (fewer
    /// rows than twice the threads) runs on the calling thread in one call.
    pub fn for_each_row_block_mut<T: Send>(
        &self,
        data: &mut [T],
        row_len: usize,
        f: &(dyn Fn(usize, &mut [T]) + Sync),
    ) {
        assert!(
            row_len > 0 && data.len().is_multiple_of(row_len),
            "row length"
        );
        let n_rows = data.len() / row_len;
        if n_rows < 2 * self.n_threads() {
            return f(0, data);
        }
        let per_block = n_rows.div_ceil(self.n_threads() * ROW_BLOCKS_PER_THREAD);
        self.for_each_block_mut(data, per_block * row_len, &|b, block| {
            f(b * per_block, block)
        });
    }

    /// Calls `f(b, block)` for the consecutive blocks of `block_len` elements of
    /// `data` (the last one possibly shorter), through [`Self::run_dynamic`].
    fn for_each_block_mut<T: Send>(
        &self,
        data: &mut [T],
        block_len: usize,
        f: &(dyn Fn(usize, &mut [T]) + Sync),
    ) {
        let len = data.len();
        let base = SendPtr(data.as_mut_ptr());
        self.run_dynamic(len.div_ceil(block_len), &|b| {
            let start = b * block_len;
            // SAFETY: block b lies inside `data` (start < len, and its length is cut
            // at len) and `run_dynamic` hands each block to exactly one call, so the
            // slices are disjoint; it returns only after every call is done.
            let block = unsafe {
                std::slice::from_raw_parts_mut(base.get().add(start), block_len.min(len - start))
            };
            f(b, block);
        });
    }
}

/// See [`ThreadPool::for_each_row_block_mut`]: a few blocks per thread balance
/// the load without a dispatch's worth of work per row.
const ROW_BLOCKS_PER_THREAD: usize = 4;

struct SendPtr<T>(*mut T);
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
impl<T> SendPtr<T> {
    /// A method, not a field access, so closures capture the whole `Sync` wrapper.
    fn get(self) -> *mut T {
        self.0
    }
}
// SAFETY: used only to hand disjoint sub-slices of one `&mut [T]` to pool threads.
unsafe impl<T: Send> Sync for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Send for SendPtr<T> {}

fn worker(s: &Shared, idx: usize) {
    let mut seen = 0u64;
    loop {
        let mut spins = 0u32;
        loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            if spins < SPIN_ITERS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            let mut l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            while s.epoch.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst) {
                l = s.wake.wait(l).unwrap_or_else(|e| e.into_inner());
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
            spins = 0;
        }
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        if enter(s, seen) {
            // SAFETY: the gate of epoch `seen` was opened after `job` was set, and
            // the dispatch keeps the closure alive (and `job` unchanged) until
            // every worker inside its gate has left.
            let job = unsafe { (*s.job.get()).map(|j| &*j) };
            if let Some(job) = job {
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(idx))).is_err() {
                    s.panicked.store(true, Ordering::Relaxed);
                }
            }
            s.pending.fetch_sub(1, Ordering::Release);
            s.gate.fetch_sub(1, Ordering::Release);
        }
    }
}

/// Enters the gate of `epoch` if it is still open; false when the dispatch has
/// moved on without this worker.
fn enter(s: &Shared, epoch: u64) -> bool {
    let want = (epoch & 0xFFFF_FFFF) << GATE_EPOCH_SHIFT;
    let mut g = s.gate.load(Ordering::Acquire);
    loop {
        if g & !(GATE_CLOSED | GATE_INSIDE) != want || g & GATE_CLOSED != 0 {
            return false;
        }
        match s
            .gate
            .compare_exchange_weak(g, g + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => return true,
            Err(now) => g = now,
        }
    }
}

/// Spins briefly, then yields the time slice until `done()`: when the machine
/// has more runnable threads than cores, the thread waited for may need this
/// core.
fn wait_until(done: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !done() {
        if spins < WAIT_SPINS_BEFORE_YIELD {
            spins += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _l = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// The default thread count: one per physical core (SMT siblings share a core's
/// vector units, which these kernels keep busy), never more than the CPUs this
/// process may run on. Physical cores are the distinct (`physical id`, `core id`)
/// pairs of `/proc/cpuinfo`; where that is not readable, every available CPU.
pub fn default_threads() -> usize {
    let available = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| physical_cores(&text))
        .map_or(available, |cores| cores.min(available))
}

/// Distinct (`physical id`, `core id`) pairs in a `/proc/cpuinfo` text; `None`
/// if it names no core ids (some architectures and kernels leave them out).
fn physical_cores(cpuinfo: &str) -> Option<usize> {
    let mut cores = std::collections::HashSet::new();
    for cpu in cpuinfo.split("\n\n") {
        let field = |name: &str| {
            cpu.lines()
                .filter_map(|l| l.split_once(':'))
                .find(|(k, _)| k.trim() == name)
                .map(|(_, v)| v.trim().to_string())
        };
        if let Some(core) = field("core id") {
            cores.insert((field("physical id").unwrap_or_default(), core));
        }
    }
    (!cores.is_empty()).then_some(cores.len())
}

/// The `[start, end)` share of `n` items for thread `idx` of `n_threads`, in
/// contiguous, nearly equal chunks.
pub fn split_range(n: usize, idx: usize, n_threads: usize) -> std::ops::Range<usize> {
    let per = n / n_threads;
    let extra = n % n_threads;
    let start = idx * per + idx.min(extra);
    let len = per + usize::from(idx < extra);
    start..start + len
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_thread_runs_once_per_call() {
        for n in [1, 2, 3, 5] {
            let pool = ThreadPool::new(n);
            for _ in 0..200 {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(&|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn parked_workers_wake_up() {
        let pool = ThreadPool::new(3);
        let sum = AtomicUsize::new(0);
        for _ in 0..3 {
            std::thread::sleep(std::time::Duration::from_millis(30));
            pool.run(&|i| {
                sum.fetch_add(i + 1, Ordering::Relaxed);
            });
        }
        assert_eq!(sum.load(Ordering::Relaxed), 3 * 6);
    }

    #[test]
    fn worker_panic_is_reported_and_pool_survives() {
        let pool = ThreadPool::new(2);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&|i| assert_ne!(i, 1, "boom"));
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.run(&|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn dynamic_units_are_each_run_once() {
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            for n in [0, 1, 2, 7, 100] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run_dynamic(n, &|u| {
                    hits[u].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    /// Dynamic dispatches that close before every worker arrives, mixed with
    /// dispatches every worker must run: no unit is lost or run twice, and a
    /// late worker never runs a closure of another dispatch.
    #[test]
    fn closed_dispatches_and_late_workers_stay_consistent() {
        for threads in [2, 3, 4] {
            let pool = ThreadPool::new(threads);
            for round in 0..3000usize {
                let n = round % 5;
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run_dynamic(n, &|u| {
                    hits[u].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                if round % 7 == 0 {
                    let each: Vec<AtomicUsize> =
                        (0..threads).map(|_| AtomicUsize::new(0)).collect();
                    pool.run(&|i| {
                        each[i].fetch_add(1, Ordering::Relaxed);
                    });
                    assert!(each.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                }
            }
        }
    }

    /// A thread held up in one unit does not hold up the others: they run the rest
    /// (a fixed split would leave half the units waiting behind the held one).
    #[test]
    fn a_delayed_thread_leaves_its_share_to_the_others() {
        let pool = ThreadPool::new(2);
        let others = AtomicUsize::new(0);
        let all_others_ran = AtomicBool::new(false);
        pool.run_dynamic(50, &|u| {
            if u == 0 {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while !all_others_ran.load(Ordering::Acquire)
                    && std::time::Instant::now() < deadline
                {
                    std::hint::spin_loop();
                }
                assert!(
                    all_others_ran.load(Ordering::Acquire),
                    "the other units waited"
                );
            } else if others.fetch_add(1, Ordering::Relaxed) == 48 {
                all_others_ran.store(true, Ordering::Release);
            }
        });
    }

    #[test]
    fn chunks_are_each_visited_once() {
        let pool = ThreadPool::new(3);
        let mut v = vec![0usize; 7 * 4];
        pool.for_each_chunk_mut(&mut v, 4, &|c, chunk| {
            chunk.iter_mut().for_each(|x| *x += c + 1)
        });
        let want: Vec<usize> = (0..7).flat_map(|c| [c + 1; 4]).collect();
        assert_eq!(v, want);
    }

    #[test]
    fn row_blocks_cover_every_row_once() {
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            for n_rows in [0, 1, 5, 6, 7, 64, 101] {
                let mut v = vec![0usize; n_rows * 3];
                pool.for_each_row_block_mut(&mut v, 3, &|first, rows| {
                    for (i, row) in rows.chunks_exact_mut(3).enumerate() {
                        row.iter_mut().for_each(|x| *x += first + i + 1);
                    }
                });
                let want: Vec<usize> = (0..n_rows).flat_map(|r| [r + 1; 3]).collect();
                assert_eq!(v, want, "{n_rows} rows on {threads} threads");
            }
        }
    }

    /// Cost of one empty dispatch (the synchronisation every matvec pays):
    /// `cargo test --release -p ds4-kernels -- --ignored --nocapture bench_dispatch`.
    #[test]
    #[ignore]
    fn bench_dispatch() {
        for n in [1, 2] {
            let pool = ThreadPool::new(n);
            let hits = AtomicUsize::new(0);
            let reps = 200_000;
            let t = std::time::Instant::now();
            for _ in 0..reps {
                pool.run(&|_| {
                    hits.fetch_add(1, Ordering::Relaxed);
                });
            }
            let ns = t.elapsed().as_nanos() as f64 / reps as f64;
            println!("{n} threads: {ns:.0} ns per dispatch");
        }
    }

    #[test]
    fn physical_cores_count_smt_siblings_once() {
        let cpu = |proc: u32, phys: u32, core: u32| {
            format!("processor\t: {proc}\nphysical id\t: {phys}\ncore id\t\t: {core}\nflags\t\t: avx2\n")
        };
        // Two sockets of two cores with two threads each: 8 CPUs, 4 cores.
        let text = [
            cpu(0, 0, 0),
            cpu(1, 0, 1),
            cpu(2, 1, 0),
            cpu(3, 1, 1),
            cpu(4, 0, 0),
            cpu(5, 0, 1),
            cpu(6, 1, 0),
            cpu(7, 1, 1),
        ]
        .join("\n");
        assert_eq!(physical_cores(&text), Some(4));
        assert_eq!(physical_cores("processor\t: 0\nmodel name\t: x\n"), None);
        let n = default_threads();
        assert!(n >= 1 && n <= std::thread::available_parallelism().map_or(1, |n| n.get()));
    }

    #[test]
    fn split_covers_everything_once() {
        for n in 0..50 {
            for t in 1..7 {
                let mut next = 0;
                for i in 0..t {
                    let r = split_range(n, i, t);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }
}
