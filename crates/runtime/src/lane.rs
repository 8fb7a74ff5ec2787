//! The prefill lane: a thread with its own share of the threads that
//! prefills one slot's prompt beside the decoding slots. A long prompt fed to
//! the shared step a quantum at a time pays, every step, attention over all
//! the context it has so far; past a few thousand tokens even one prompt token
//! costs a decode step, so the decoders' streams slow by more than any bound
//! and the prompt crawls (SmolLM2, 2 threads, 6144 cold tokens beside a
//! decoder: 85 s, gaps p99 5.9x idle). On its own threads the prompt runs in
//! whole chunks while the decoders step on the rest (decode on 1 of 2 threads
//! is 1.6x slower, and chunked prefill is compute-bound, so it barely touches
//! the decoders' memory bandwidth). The slot's session is lent to the lane for
//! one chunk at a time and comes back after each, where the scheduler handles
//! its save points, progress and cancellation as for any prefill step.
//!
//! Results do not depend on the threads a forward pass runs on, so a prompt
//! prefilled here continues exactly as one prefilled in the shared step.

use std::sync::{mpsc, Arc};
use std::time::Instant;

use ds4_engine::{Batch, EngineError, Session, ThreadPool};

/// A chunk of a slot's prompt, and the session it goes into.
pub(crate) struct Chunk {
    pub slot: usize,
    pub session: Session,
    pub tokens: Vec<u32>,
}

/// A chunk done: the session with it appended (unless `result` says why not)
/// and how long it took.
pub(crate) struct Prefilled {
    pub slot: usize,
    pub session: Session,
    pub result: Result<(), EngineError>,
    pub secs: f64,
}

pub(crate) struct Lane {
    tx: Option<mpsc::Sender<Chunk>>,
    rx: mpsc::Receiver<Prefilled>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The slot whose session is in the lane.
    busy: Option<usize>,
}

impl Lane {
    /// A lane of `threads` threads (its own and `threads - 1` workers) for
    /// sessions of `model`, chunks of up to `max_rows` tokens.
    pub fn start(model: Arc<ds4_engine::Model>, threads: usize, max_rows: usize) -> Lane {
        let (tx, chunks) = mpsc::channel::<Chunk>();
        let (back, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("ds4-prefill".into())
            .spawn(move || {
                let pool = Arc::new(ThreadPool::new(threads));
                let mut batch = Batch::new(model, pool, max_rows);
                for mut c in chunks {
                    let t = Instant::now();
                    let result = batch.forward(&mut [(&mut c.session, &c.tokens[..])]);
                    let done = Prefilled {
                        slot: c.slot,
                        session: c.session,
                        result,
                        secs: t.elapsed().as_secs_f64(),
                    };
                    if back.send(done).is_err() {
                        return;
                    }
                }
            })
            .expect("spawning the prefill thread");
        Lane {
            tx: Some(tx),
            rx,
            thread: Some(thread),
            busy: None,
        }
    }

    /// The slot whose session is in the lane, if one is.
    pub fn busy(&self) -> Option<usize> {
        self.busy
    }

    /// Hands a chunk to the lane; gives it back at once, undone, when the lane
    /// is gone (its thread panicked).
    pub fn lend(&mut self, c: Chunk) -> Result<(), Box<Prefilled>> {
        let undone = |c: Chunk| {
            Box::new(Prefilled {
                slot: c.slot,
                session: c.session,
                result: Err(EngineError::Batch {
                    reason: "the prefill thread is gone".into(),
                }),
                secs: 0.0,
            })
        };
        match &self.tx {
            Some(tx) if self.busy.is_none() => {
                let slot = c.slot;
                tx.send(c).map_err(|e| undone(e.0))?;
                self.busy = Some(slot);
                Ok(())
            }
            _ => Err(undone(c)),
        }
    }

    /// The chunk in the lane, once it is done (waiting up to `wait`).
    pub fn take(&mut self, wait: std::time::Duration) -> Taken {
        let Some(slot) = self.busy else {
            return Taken::Pending;
        };
        match self.rx.recv_timeout(wait) {
            Ok(p) => {
                self.busy = None;
                Taken::Done(Box::new(p))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => Taken::Pending,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                // The thread died (a panic) with the session in it.
                self.tx = None;
                self.busy = None;
                Taken::Lost(slot)
            }
        }
    }
}

/// What [`Lane::take`] found.
pub(crate) enum Taken {
    /// Nothing yet, or nothing in the lane.
    Pending,
    Done(Box<Prefilled>),
    /// The lane's thread is gone with this slot's session.
    Lost(usize),
}

impl Drop for Lane {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
