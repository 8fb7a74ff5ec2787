//! Turn-end saves off the engine thread. When a job that asks for one
//! ([`Job::turn_save`](crate::Job::turn_save)) is done, its slot's session —
//! the whole conversation, prompt and answer — is lent to this thread, which
//! writes it as a checkpoint and hands it back. Nothing is copied on the engine
//! thread (a 6k-token SmolLM2 state is 138 MB: a copy there would stall every
//! other slot's stream), so no token waits for a save; only a job that needs
//! the lent conversation itself waits for it to come back.
//!
//! One file per conversation: the previous turn end of the slot's
//! conversation is removed once the new one is written, when its text is a
//! prefix of the new one's and the new state can be cut back to it (the lent
//! session is what a load gives, so its `can_rewind` is the answer: dense K/V
//! always can; a sliding window or compressed state may not, and then the
//! older file stays, down-weighted as a superseded waypoint).

use std::path::PathBuf;
use std::sync::{mpsc, Arc};

use ds4_engine::Session;
use ds4_kvstore::{text_hash, SaveReason};

use crate::persist::Writer;

/// A turn-end checkpoint a slot wrote: what the next one may supersede.
#[derive(Clone, Debug)]
pub(crate) struct TurnFile {
    path: PathBuf,
    tokens: usize,
    text_bytes: usize,
    /// SHA-1 of its text (what the store names it by).
    text_hash: [u8; 20],
}

/// A session lent to the saver.
pub(crate) struct Lend {
    pub slot: usize,
    pub session: Session,
    pub reason: SaveReason,
    /// The session's text (`prompt_text` of its tokens).
    pub text: Vec<u8>,
    /// The slot's last turn-end checkpoint.
    pub previous: Option<TurnFile>,
}

/// A session handed back, with the checkpoint that now holds it.
pub(crate) struct Returned {
    pub slot: usize,
    pub session: Session,
    pub saved: Option<TurnFile>,
}

pub(crate) struct Saver {
    tx: Option<mpsc::Sender<Lend>>,
    rx: mpsc::Receiver<Returned>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Saver {
    pub fn start(writer: Arc<Writer>) -> Saver {
        let (tx, lent) = mpsc::channel::<Lend>();
        let (back, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("ds4-saver".into())
            .spawn(move || {
                for l in lent {
                    let saved = save(&writer, &l);
                    let returned = Returned {
                        slot: l.slot,
                        session: l.session,
                        saved,
                    };
                    if back.send(returned).is_err() {
                        return;
                    }
                }
            })
            .expect("spawning the saver thread");
        Saver {
            tx: Some(tx),
            rx,
            thread: Some(thread),
        }
    }

    /// Lends a session; gives it back at once when the saver is gone.
    pub fn lend(&self, l: Lend) -> Result<(), Box<Returned>> {
        let back = |l: Lend| {
            Box::new(Returned {
                slot: l.slot,
                session: l.session,
                saved: l.previous,
            })
        };
        match &self.tx {
            Some(tx) => tx.send(l).map_err(|e| back(e.0)),
            None => Err(back(l)),
        }
    }

    /// A session whose save is done, if one is.
    pub fn try_take(&self) -> Option<Returned> {
        self.rx.try_recv().ok()
    }

    /// Waits for the next session whose save is done.
    pub fn take(&self) -> Option<Returned> {
        self.rx.recv().ok()
    }

    /// Stops taking sessions and waits for those lent: every one comes back.
    pub fn finish(&mut self) -> Vec<Returned> {
        self.tx = None;
        let back = self.rx.iter().collect();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        back
    }
}

/// Writes a lent session and removes the turn end it supersedes.
fn save(writer: &Writer, l: &Lend) -> Option<TurnFile> {
    let Some((path, _)) = writer.save_text(l.slot, &l.session, l.reason, &l.text) else {
        // Too short to keep, skipped or failed (reported): the previous one
        // still serves what it did.
        return l.previous.clone();
    };
    // An anchor (the agent's system prompt, `agent-system`) is no turn end of
    // a conversation: the next turn end that extends it does not replace it.
    if !l.reason.is_waypoint() {
        return None;
    }
    let tokens = l.session.tokens().len();
    if let Some(prev) = &l.previous {
        let prefix = prev.text_bytes < l.text.len()
            && text_hash(&l.text[..prev.text_bytes]) == prev.text_hash;
        if prev.path != path && prefix && l.session.can_rewind(prev.tokens) {
            writer.remove(
                &prev.path,
                &format!(
                    "the conversation's next turn end ({} tokens, {}) holds it",
                    tokens,
                    path.display()
                ),
            );
        }
    }
    Some(TurnFile {
        path,
        tokens,
        text_bytes: l.text.len(),
        text_hash: text_hash(&l.text),
    })
}
