//! The session index: one small JSON file per conversation (`<id>.json`, 0600,
//! in a 0700 directory) with its title, messages, token count, times and the
//! name of the checkpoint that holds its state. The state itself is a
//! checkpoint in the agent's store; the index is what lists, titles and
//! re-renders it. Writes are atomic (a temp file, then `rename`).

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use ds4_chat::{Message, Role};
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a session file: {source}")]
    Format {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("no session {0:?}")]
    NotFound(String),
    #[error("{0:?} is not a session id (hex digits)")]
    BadId(String),
}

/// One conversation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRecord {
    pub id: String,
    /// From the first user message.
    pub title: String,
    /// Unix seconds.
    pub created: u64,
    pub updated: u64,
    /// Tokens of its state (prompt and answers) at the last turn's end.
    pub tokens: usize,
    /// The names (text SHA-1s) of the checkpoints its turns were saved to,
    /// the latest last (removed with it, or by `/strip`).
    #[serde(default)]
    pub checkpoints: Vec<String>,
    /// Its payload was dropped (`/strip`): switching to it prefills again.
    #[serde(default)]
    pub stripped: bool,
    /// The conversation after the system prompt (tool calls with the exact
    /// text the model sampled, re-rendered verbatim so the conversation's
    /// text stays its checkpoint's).
    pub messages: Vec<Message>,
}

impl SessionRecord {
    /// A new, empty session with a fresh id.
    pub fn new(id: String, now: u64) -> Self {
        SessionRecord {
            id,
            created: now,
            updated: now,
            ..SessionRecord::default()
        }
    }

    /// Replaces the conversation; the title is the first user message's first
    /// line (60 characters at most).
    pub fn set_messages(&mut self, messages: &[Message], now: u64) {
        self.messages = messages.to_vec();
        self.updated = now;
        if self.title.is_empty() {
            if let Some(first) = messages.iter().find(|m| m.role == Role::User) {
                let line = first.content.lines().next().unwrap_or("");
                self.title = line.chars().take(60).collect();
            }
        }
    }
}

/// The directory of session files.
pub struct SessionIndex {
    dir: PathBuf,
}

impl SessionIndex {
    /// Opens (creating, 0700) the index at `dir`.
    pub fn open(dir: &Path) -> Result<SessionIndex, SessionError> {
        let io = |source| SessionError::Io {
            path: dir.to_path_buf(),
            source,
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
        Ok(SessionIndex {
            dir: dir.to_path_buf(),
        })
    }

    fn path(&self, id: &str) -> Result<PathBuf, SessionError> {
        if id.is_empty() || !id.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(SessionError::BadId(id.to_string()));
        }
        Ok(self.dir.join(format!("{id}.json")))
    }

    /// An id no session has: 8 hex digits.
    pub fn fresh_id(&self) -> String {
        use std::hash::{BuildHasher, Hasher};
        loop {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()),
            );
            let id = format!("{:08x}", h.finish() as u32);
            if self.path(&id).is_ok_and(|p| !p.exists()) {
                return id;
            }
        }
    }

    /// Writes `rec` (0600, atomically).
    pub fn save(&self, rec: &SessionRecord) -> Result<(), SessionError> {
        let path = self.path(&rec.id)?;
        let tmp = self
            .dir
            .join(format!("{}.json.tmp.{}", rec.id, std::process::id()));
        let io = |source| SessionError::Io {
            path: path.clone(),
            source,
        };
        let text = serde_json::to_vec_pretty(rec).map_err(|source| SessionError::Format {
            path: path.clone(),
            source,
        })?;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io)?;
        f.write_all(&text).map_err(io)?;
        f.sync_all().map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)
    }

    pub fn load(&self, id: &str) -> Result<SessionRecord, SessionError> {
        let path = self.path(id)?;
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(SessionError::NotFound(id.to_string()))
            }
            Err(source) => return Err(SessionError::Io { path, source }),
        };
        serde_json::from_slice(&text).map_err(|source| SessionError::Format { path, source })
    }

    /// Every readable session, the most recently updated first.
    pub fn list(&self) -> Result<Vec<SessionRecord>, SessionError> {
        let entries = std::fs::read_dir(&self.dir).map_err(|source| SessionError::Io {
            path: self.dir.clone(),
            source,
        })?;
        let mut out: Vec<SessionRecord> = entries
            .filter_map(Result::ok)
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                self.load(name.strip_suffix(".json")?).ok()
            })
            .collect();
        out.sort_by(|a, b| b.updated.cmp(&a.updated).then(a.id.cmp(&b.id)));
        Ok(out)
    }

    pub fn remove(&self, id: &str) -> Result<(), SessionError> {
        let path = self.path(id)?;
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(SessionError::NotFound(id.to_string()))
            }
            Err(source) => Err(SessionError::Io { path, source }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_chat::ToolCall;

    #[test]
    fn sessions_round_trip_privately_and_ids_are_checked() {
        let dir = std::env::temp_dir().join(format!("ds4-agent-index-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let index = SessionIndex::open(&dir.join("sessions")).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir.join("sessions")), 0o700);
        let mut rec = SessionRecord::new(index.fresh_id(), 10);
        let mut call = Message::new(Role::Assistant, "");
        call.tool_calls = vec![ToolCall {
            id: "call_1".into(),
            name: "list".into(),
            arguments: r#"{"path":"."}"#.into(),
        }];
        call.tool_calls_raw = Some("<tool_call>\n{...}\n</tool_call>".into());
        let mut result = Message::new(Role::Tool, "a.txt");
        result.tool_call_id = Some("call_1".into());
        let messages = vec![
            Message::new(Role::User, "list the files\nplease"),
            call,
            result,
            Message::new(Role::Assistant, "There is a.txt."),
        ];
        rec.set_messages(&messages, 20);
        rec.tokens = 123;
        index.save(&rec).unwrap();
        assert_eq!(mode(&dir.join(format!("sessions/{}.json", rec.id))), 0o600);
        let back = index.load(&rec.id).unwrap();
        assert_eq!(back, rec);
        assert_eq!(back.title, "list the files");
        assert_eq!(back.messages, messages);
        let other = SessionRecord::new(index.fresh_id(), 30);
        index.save(&other).unwrap();
        let ids: Vec<String> = index.list().unwrap().into_iter().map(|r| r.id).collect();
        assert_eq!(ids, [other.id.clone(), rec.id.clone()]);
        for bad in ["../x", "", "zz", "a/b"] {
            assert!(matches!(index.load(bad), Err(SessionError::BadId(_))));
        }
        assert!(matches!(index.load("abc"), Err(SessionError::NotFound(_))));
        index.remove(&rec.id).unwrap();
        assert!(matches!(
            index.remove(&rec.id),
            Err(SessionError::NotFound(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
