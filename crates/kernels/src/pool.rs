//! A persistent thread pool for the forward pass. Each `run` hands the same closure
//! to every thread with its index; `run_dynamic` hands out numbered units of work
//! to whichever thread is free.
//!
//! Tuned for decode, where one token issues hundreds of short matvecs: workers spin
//! briefly on an epoch counter before parking on a condvar, and dispatch takes no lock
//! unless a worker is parked. `run` allocates nothing.

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

struct Shared {
    epoch: AtomicU64,
    /// The job of the current epoch. Written only by `run` while no worker reads it.
    job: UnsafeCell<Option<*const Job>>,
    pending: AtomicUsize,
    sleepers: AtomicUsize,
    shutdown: AtomicBool,
    panicked: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written by `run` only before the epoch is published (Release) and
// after every worker has finished the previous epoch (`pending` reached 0, Acquire);
// workers read it only after observing the new epoch (Acquire). The pointee is `Sync`.
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
        let _guard = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY: erase the lifetime of `f`; we do not return before every worker has
        // finished with it (`pending` reaches 0 below), so it outlives all uses.
        let job: *const Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &Job>(f) };
        // SAFETY: no worker reads `job` now: the previous epoch completed.
        unsafe { *s.job.get() = Some(job) };
        s.pending.store(self.workers.len(), Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let main_result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(0)));
        let mut spins = 0u32;
        while s.pending.load(Ordering::Acquire) != 0 {
            if spins < WAIT_SPINS_BEFORE_YIELD {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
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
        self.run(&|_| loop {
            let unit = next.fetch_add(1, Ordering::Relaxed);
            if unit >= n_units {
                break;
            }
            f(unit);
        });
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
        // SAFETY: the epoch was published after `job` was set, and `run` keeps the
        // closure alive until `pending` reaches zero.
        let job = unsafe { (*s.job.get()).map(|j| &*j) };
        if let Some(job) = job {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(idx))).is_err() {
                s.panicked.store(true, Ordering::Relaxed);
            }
        }
        s.pending.fetch_sub(1, Ordering::Release);
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
