//! Stored conversations for stateful requests (the Responses API's
//! `store` and `previous_response_id`): each stored response's whole
//! conversation — the messages it was asked and its answer — by response id.
//! A request that names a previous response sends only its new input; the
//! stored messages go before it, the prompt renders as the full replay would,
//! and the reuse plan finds the state by its text (the live slot, or the
//! conversation's turn-end checkpoint after a restart).
//!
//! On disk beside the checkpoint store (`<dir>/<id>.json`, 0600 in a 0700
//! folder, written atomically) so a restart keeps them; in memory without a
//! store. Bounded in count and bytes: the oldest go first, and an id past the
//! bound is as unknown as one never stored.

use std::collections::{HashMap, VecDeque};
use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ds4_chat::Message;
use serde::{Deserialize, Serialize};

/// The most conversations kept, and the most bytes their files take.
pub const MAX_CONVERSATIONS: usize = 4096;
pub const MAX_CONVERSATION_BYTES: u64 = 512 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ConversationError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a stored conversation: {source}")]
    Format {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("the conversation is {bytes} bytes, more than the {max} the store keeps")]
    TooLarge { bytes: u64, max: u64 },
}

#[derive(Serialize, Deserialize)]
struct Stored {
    version: u32,
    id: String,
    messages: Vec<Message>,
}

const VERSION: u32 = 1;

/// Where conversations are kept, and their order (oldest first) and sizes.
pub struct Conversations {
    dir: Option<PathBuf>,
    max_count: usize,
    max_bytes: u64,
    state: Mutex<Index>,
}

#[derive(Default)]
struct Index {
    order: VecDeque<String>,
    bytes: HashMap<String, u64>,
    total: u64,
    /// Without a folder: the conversations themselves.
    memory: HashMap<String, Vec<Message>>,
}

/// Ids are ours (`resp_` and hex) or at least a file name's safe characters:
/// anything else is never a stored id, so no id reads outside the folder.
fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl std::fmt::Debug for Conversations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conversations")
            .field("dir", &self.dir)
            .field("kept", &self.lock().order.len())
            .finish()
    }
}

impl Conversations {
    /// Kept in `dir` (created 0700), or in memory with `None`.
    pub fn open(dir: Option<&Path>) -> Result<Self, ConversationError> {
        Self::with_limits(dir, MAX_CONVERSATIONS, MAX_CONVERSATION_BYTES)
    }

    pub fn with_limits(
        dir: Option<&Path>,
        max_count: usize,
        max_bytes: u64,
    ) -> Result<Self, ConversationError> {
        let mut index = Index::default();
        if let Some(dir) = dir {
            let io = |what, source| ConversationError::Io {
                what,
                path: dir.to_path_buf(),
                source,
            };
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| io("creating", e))?;
            let mut found = Vec::new();
            for e in fs::read_dir(dir).map_err(|e| io("listing", e))? {
                let Ok(e) = e else { continue };
                let name = e.file_name().to_string_lossy().into_owned();
                let Some(id) = name.strip_suffix(".json").filter(|id| valid_id(id)) else {
                    continue;
                };
                if let Some(meta) = e.metadata().ok().filter(|m| m.is_file()) {
                    let modified = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
                    found.push((modified, id.to_string(), meta.len()));
                }
            }
            found.sort();
            for (_, id, bytes) in found {
                index.total += bytes;
                index.bytes.insert(id.clone(), bytes);
                index.order.push_back(id);
            }
        }
        let c = Conversations {
            dir: dir.map(Path::to_path_buf),
            max_count: max_count.max(1),
            max_bytes,
            state: Mutex::new(index),
        };
        c.trim(&mut c.lock());
        Ok(c)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn path(&self, dir: &Path, id: &str) -> PathBuf {
        dir.join(format!("{id}.json"))
    }

    /// Keeps `messages` as the conversation of response `id`.
    pub fn put(&self, id: &str, messages: &[Message]) -> Result<(), ConversationError> {
        if !valid_id(id) {
            return Ok(());
        }
        let stored = Stored {
            version: VERSION,
            id: id.to_string(),
            messages: messages.to_vec(),
        };
        let bytes = serde_json::to_vec(&stored).map_err(|source| ConversationError::Format {
            path: PathBuf::from(id),
            source,
        })?;
        let size = bytes.len() as u64;
        if size > self.max_bytes {
            return Err(ConversationError::TooLarge {
                bytes: size,
                max: self.max_bytes,
            });
        }
        if let Some(dir) = &self.dir {
            let path = self.path(dir, id);
            let tmp = dir.join(format!(".{id}.json.tmp.{}", std::process::id()));
            let io = |what, source| ConversationError::Io {
                what,
                path: path.clone(),
                source,
            };
            let write = || -> std::io::Result<()> {
                let mut f = fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(&tmp)?;
                f.write_all(&bytes)?;
                f.sync_all()?;
                fs::rename(&tmp, &path)
            };
            if let Err(e) = write() {
                let _ = fs::remove_file(&tmp);
                return Err(io("writing", e));
            }
        }
        let mut ix = self.lock();
        ix.forget(id);
        ix.order.push_back(id.to_string());
        ix.bytes.insert(id.to_string(), size);
        ix.total += size;
        if self.dir.is_none() {
            ix.memory.insert(id.to_string(), messages.to_vec());
        }
        self.trim(&mut ix);
        Ok(())
    }

    /// The conversation of response `id`, if it is kept.
    pub fn get(&self, id: &str) -> Result<Option<Vec<Message>>, ConversationError> {
        if !valid_id(id) {
            return Ok(None);
        }
        let Some(dir) = &self.dir else {
            return Ok(self.lock().memory.get(id).cloned());
        };
        let path = self.path(dir, id);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(ConversationError::Io {
                    what: "reading",
                    path,
                    source,
                })
            }
        };
        let stored: Stored = serde_json::from_slice(&bytes)
            .map_err(|source| ConversationError::Format { path, source })?;
        Ok((stored.version == VERSION && stored.id == id).then_some(stored.messages))
    }

    /// Drops the oldest past the bounds.
    fn trim(&self, ix: &mut Index) {
        while ix.order.len() > self.max_count || ix.total > self.max_bytes {
            let Some(id) = ix.order.front().cloned() else {
                break;
            };
            ix.forget(&id);
            if let Some(dir) = &self.dir {
                let _ = fs::remove_file(self.path(dir, &id));
            }
        }
    }
}

impl Index {
    fn forget(&mut self, id: &str) {
        if let Some(b) = self.bytes.remove(id) {
            self.total -= b;
            self.order.retain(|x| x != id);
            self.memory.remove(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use ds4_chat::{Role, ToolCall};

    use super::*;

    fn conversation(n: usize) -> Vec<Message> {
        let mut a = Message::new(Role::Assistant, format!("answer {n}"));
        a.tool_calls.push(ToolCall {
            id: format!("call_{n}"),
            name: "read".into(),
            arguments: r#"{"path":"a"}"#.into(),
        });
        vec![Message::new(Role::User, format!("question {n}")), a]
    }

    #[test]
    fn kept_on_disk_across_reopening_bounded_and_private() {
        let dir = std::env::temp_dir().join(format!("ds4-conv-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let c = Conversations::with_limits(Some(&dir), 3, 1 << 20).unwrap();
        for n in 0..4 {
            c.put(&format!("resp_{n}"), &conversation(n)).unwrap();
        }
        // The oldest went past the bound of three.
        assert_eq!(c.get("resp_0").unwrap(), None);
        let again = Conversations::with_limits(Some(&dir), 3, 1 << 20).unwrap();
        assert_eq!(again.get("resp_3").unwrap(), Some(conversation(3)));
        assert_eq!(again.get("resp_9").unwrap(), None);
        // Ids that are not file-name safe are never found.
        for bad in ["../x", "a/b", "", ".hidden", &"x".repeat(200)] {
            assert_eq!(again.get(bad).unwrap(), None, "{bad:?}");
        }
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("resp_3.json")), 0o600);
        // A damaged file is an error naming it, not a conversation.
        fs::write(dir.join("resp_2.json"), b"{").unwrap();
        let e = again.get("resp_2").unwrap_err().to_string();
        assert!(e.contains("resp_2.json"), "{e}");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn kept_in_memory_without_a_folder_and_bounded_in_bytes() {
        let c = Conversations::with_limits(None, 100, 400).unwrap();
        c.put("resp_a", &conversation(1)).unwrap();
        assert_eq!(c.get("resp_a").unwrap(), Some(conversation(1)));
        for n in 0..10 {
            c.put(&format!("resp_{n}"), &conversation(n)).unwrap();
        }
        assert_eq!(c.get("resp_a").unwrap(), None);
        assert_eq!(c.get("resp_9").unwrap(), Some(conversation(9)));
        let huge = vec![Message::new(Role::User, "x".repeat(1000))];
        assert!(matches!(
            c.put("resp_h", &huge),
            Err(ConversationError::TooLarge { .. })
        ));
    }
}
