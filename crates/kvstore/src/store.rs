//! The store: one directory of checkpoint files, an in-memory index built from headers
//! only, lookup by rendered-text prefix, verified load with an in-place usage update,
//! atomic save, budget enforcement, `ls` and `verify`. Unix only (file modes, positioned
//! I/O, `/proc` for stale temp files).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, BufWriter, Read, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use sha1::{Digest, Sha1};
use xxhash_rust::xxh3::Xxh3;

use crate::error::{Defect, KvError};
use crate::format::{
    decode_sections, encode_sections, hex, parse_checkpoint_name, parse_hash, parse_temp_name,
    text_hash, Header, Mismatch, ModelId, SaveReason, Section, FORMAT_VERSION, HEADER_LEN,
    USAGE_OFFSET,
};
use crate::policy::SavePolicy;
use crate::score::eviction_score;

/// Reads and writes move this many bytes per call.
const IO_CHUNK: usize = 8 << 20;
/// A temp file of a live process older than this is stale and removed.
pub const STALE_TEMP_AGE_S: u64 = 3600;
/// Characters of text shown by [`Store::entries`].
pub const EXCERPT_CHARS: usize = 60;

/// A checkpoint that shares a prefix with a prompt but diverges from it, to load.
#[derive(Clone, Debug)]
pub struct Shared {
    pub candidate: Candidate,
    /// Bytes its text shares with the prompt.
    pub common_bytes: usize,
    pub text: Vec<u8>,
}

/// A checkpoint that shares a prefix with a prompt but diverges from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NearMiss {
    pub path: PathBuf,
    /// Tokens the checkpoint holds.
    pub tokens: u32,
    /// Bytes its text shares with the prompt.
    pub common_bytes: usize,
    pub text: Vec<u8>,
}

/// Store settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreConfig {
    /// Byte budget for all valid checkpoint files in the directory
    /// (`--kv-disk-space-mb`). Default 4096 MiB.
    pub budget_bytes: u64,
    /// Save policy; the store only carries it for the caller (see [`SavePolicy`]).
    pub policy: SavePolicy,
    /// Refuse checkpoints written by another quantization of the same model
    /// (`--kv-cache-reject-different-quant`).
    pub reject_different_quant: bool,
    /// Inspect only (`ds4 kv ls`, `show`, `verify` without `--fix`): change
    /// nothing on disk — no directory created, no stale temp file removed (each
    /// is reported as [`Notice::StaleTemp`]), no eviction, no usage update on
    /// load; saving and removing are refused.
    pub read_only: bool,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            budget_bytes: 4096 << 20,
            policy: SavePolicy::default(),
            reject_different_quant: false,
            read_only: false,
        }
    }
}

/// Something an operator should see in the log. Each is reported once
/// ([`Store::drain_notices`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Notice {
    /// A file in the directory is not used (bad header, wrong size, foreign name ...).
    Skipped { file: PathBuf, defect: Defect },
    /// A stale `*.tmp.<pid>` file was removed.
    RemovedTemp { file: PathBuf, why: &'static str },
    /// A stale temp file could not be removed.
    TempRemoveFailed { file: PathBuf, error: String },
    /// A stale temp file was left in place (a read-only store).
    StaleTemp { file: PathBuf, why: &'static str },
    /// A checkpoint was deleted to get under budget.
    Evicted(Evicted),
    /// A checkpoint chosen for eviction could not be deleted.
    EvictFailed { file: PathBuf, error: String },
    /// The existing directory is readable by group or others; left unchanged.
    InsecureDir { dir: PathBuf, mode: u32 },
}

impl fmt::Display for Notice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Notice::Skipped { file, defect } => {
                write!(f, "kv cache skipped file={}: {defect}", file.display())
            }
            Notice::RemovedTemp { file, why } => {
                write!(f, "kv cache removed stale temp file={} ({why})", file.display())
            }
            Notice::StaleTemp { file, why } => write!(
                f,
                "kv cache stale temp file={} ({why}); `ds4 kv verify --fix` removes it",
                file.display()
            ),
            Notice::TempRemoveFailed { file, error } => write!(
                f,
                "kv cache could not remove stale temp file={}: {error}",
                file.display()
            ),
            Notice::Evicted(e) => write!(
                f,
                "kv cache evicted reason=disk-cache-full saved={} tokens={} hits={} size={} score={:.3e} file={}",
                e.reason,
                e.tokens,
                e.hits,
                e.file_bytes,
                e.score,
                e.file.display()
            ),
            Notice::EvictFailed { file, error } => {
                write!(f, "kv cache could not evict file={}: {error}", file.display())
            }
            Notice::InsecureDir { dir, mode } => write!(
                f,
                "kv cache directory {} has mode {mode:03o}: it holds prompts verbatim; consider chmod 700",
                dir.display()
            ),
        }
    }
}

/// One eviction.
#[derive(Clone, Debug, PartialEq)]
pub struct Evicted {
    pub file: PathBuf,
    pub reason: SaveReason,
    pub tokens: u32,
    pub hits: u32,
    pub file_bytes: u64,
    pub score: f64,
}

/// The best checkpoint for a prompt, from [`Store::lookup`], or one sharing a
/// prefix with it, from [`Store::sharing`].
#[derive(Clone, Debug)]
pub struct Candidate {
    /// 40 lowercase hex digits: SHA-1 of the rendered text.
    pub hash: String,
    pub path: PathBuf,
    /// The header as indexed (tokens, text length, ...).
    pub header: Header,
    model: ModelId,
    n_ctx: u32,
    /// `None`: its text is a prefix of the prompt ([`Store::lookup`]);
    /// `Some(n)`: it shares exactly the first `n` bytes ([`Store::sharing`]).
    shared: Option<usize>,
}

/// A verified checkpoint.
#[derive(Clone, Debug)]
pub struct Loaded {
    /// The header after the in-place usage update (hits incremented, last_used now).
    pub header: Header,
    pub text: Vec<u8>,
    pub payload: Vec<u8>,
    pub sections: Vec<Section>,
}

/// The engine payload to save.
pub enum Payload<'a> {
    Bytes(&'a [u8]),
    /// Streamed by the callback into the file. `estimated_bytes` feeds the budget
    /// pre-check; the header records the bytes actually written.
    Stream {
        estimated_bytes: u64,
        write: &'a mut (dyn FnMut(&mut dyn Write) -> io::Result<()> + 'a),
    },
}

impl Payload<'_> {
    fn estimated_bytes(&self) -> u64 {
        match self {
            Payload::Bytes(b) => b.len() as u64,
            Payload::Stream {
                estimated_bytes, ..
            } => *estimated_bytes,
        }
    }
}

/// Everything a save needs.
pub struct SaveRequest<'a> {
    /// Rendered text of the cached prefix: the identity (SHA-1 → file name).
    pub text: &'a [u8],
    pub payload: Payload<'a>,
    pub reason: SaveReason,
    /// Tokens in the cached prefix; at least 1.
    pub tokens: u32,
    /// Context size of the saving session; at least `tokens`.
    pub n_ctx: u32,
    pub model: ModelId,
    /// Written verbatim ([`crate::EXT_TOOL_ID_MAP`] when a tool-id map section is
    /// included).
    pub ext_flags: u32,
    pub sections: &'a [Section],
}

/// What a save did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SaveOutcome {
    /// A new file is in place (`replaced`: an incompatible same-name file was replaced).
    Saved {
        path: PathBuf,
        file_bytes: u64,
        replaced: bool,
    },
    /// A compatible file with the same text already existed; its last-used time was
    /// updated and nothing was written.
    Kept { path: PathBuf },
    /// Nothing was written, by design.
    Skipped(SkipReason),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SkipReason {
    /// The file would not fit in the budget even if everything else were evicted.
    OverBudget { file_bytes: u64, budget_bytes: u64 },
    /// This process is already writing the same checkpoint.
    InFlight,
}

/// One line of `ds4 kv ls`.
#[derive(Clone, Debug)]
pub struct EntryInfo {
    pub hash: String,
    pub path: PathBuf,
    pub header: Header,
    pub file_bytes: u64,
    /// A `continued` checkpoint that a newer checkpoint extends.
    pub superseded: bool,
    pub score: f64,
    /// The first [`EXCERPT_CHARS`] characters of the text (lossy UTF-8).
    pub excerpt: String,
}

/// Result of [`Store::verify`].
#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    /// Checkpoint-named files examined.
    pub checked: usize,
    pub ok: usize,
    pub bad: Vec<(PathBuf, Defect)>,
    /// Files that could not be read (permissions, I/O errors); never removed.
    pub unreadable: Vec<(PathBuf, String)>,
    /// Bad files deleted (with `fix`).
    pub removed: Vec<PathBuf>,
}

/// The on-disk checkpoint store. All methods take `&self`; the index sits behind a
/// mutex that is not held while payloads are read or written, so a `Store` can be
/// shared between threads.
pub struct Store {
    dir: PathBuf,
    config: StoreConfig,
    state: Mutex<State>,
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("dir", &self.dir)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct State {
    /// Every non-temp name in the directory at the last scan.
    files: HashMap<String, Scanned>,
    notices: Vec<Notice>,
    /// Temp file names this store is writing right now.
    in_flight: HashSet<String>,
    /// Temp files whose removal failed (reported once).
    temp_failed: HashSet<String>,
}

#[derive(Clone)]
struct Scanned {
    stamp: Stamp,
    result: Result<Entry, Defect>,
}

#[derive(Clone)]
struct Entry {
    hash: [u8; 20],
    header: Header,
    file_bytes: u64,
}

/// What decides whether a file must be re-read: any write or rename changes it (up to
/// the file system's timestamp granularity; see the crate docs on staleness).
#[derive(Clone, Copy, PartialEq, Eq)]
struct Stamp {
    len: u64,
    ino: u64,
    dev: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(m: &fs::Metadata) -> Stamp {
        Stamp {
            len: m.len(),
            ino: m.ino(),
            dev: m.dev(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }
}

/// Current Unix time in seconds.
pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Store {
    /// Open (creating it with mode 0700 if missing) the directory, index every
    /// checkpoint header, remove stale temp files, and evict down to the budget.
    /// An existing directory keeps its permissions; if group or others can access it
    /// a [`Notice::InsecureDir`] is queued.
    pub fn open(dir: impl Into<PathBuf>, config: StoreConfig) -> Result<Store, KvError> {
        let dir = dir.into();
        let mut notices = Vec::new();
        match fs::metadata(&dir) {
            Ok(m) if m.is_dir() => {
                let mode = m.permissions().mode() & 0o777;
                if mode & 0o077 != 0 {
                    notices.push(Notice::InsecureDir {
                        dir: dir.clone(),
                        mode,
                    });
                }
            }
            Ok(_) => {
                return Err(KvError::io(
                    "open store directory",
                    &dir,
                    io::Error::new(
                        io::ErrorKind::NotADirectory,
                        "exists and is not a directory",
                    ),
                ))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound && !config.read_only => {
                DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(&dir)
                    .map_err(|e| KvError::io("create store directory", &dir, e))?;
                // The umask may have removed owner bits; set exactly 0700.
                fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))
                    .map_err(|e| KvError::io("chmod store directory", &dir, e))?;
            }
            Err(e) => return Err(KvError::io("open store directory", &dir, e)),
        }
        let store = Store {
            dir,
            config,
            state: Mutex::new(State {
                notices,
                ..State::default()
            }),
        };
        {
            let mut st = store.lock();
            match store.config.read_only {
                true => store.scan(&mut st)?,
                false => store.evict_locked(&mut st, None, now_unix())?,
            }
        }
        Ok(store)
    }

    /// Refuses a change to a read-only store.
    fn writable(&self) -> Result<(), KvError> {
        match self.config.read_only {
            true => Err(KvError::InvalidRequest(
                "the store was opened read-only".into(),
            )),
            false => Ok(()),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    pub fn policy(&self) -> &SavePolicy {
        &self.config.policy
    }

    /// Notices queued since the last call, oldest first.
    pub fn drain_notices(&self) -> Vec<Notice> {
        std::mem::take(&mut self.lock().notices)
    }

    /// Files currently known to be unusable (as of the last scan or failed load).
    pub fn skipped(&self) -> Vec<(PathBuf, Defect)> {
        let st = self.lock();
        let mut v: Vec<_> = st
            .files
            .iter()
            .filter_map(|(n, s)| {
                s.result
                    .as_ref()
                    .err()
                    .map(|d| (self.dir.join(n), d.clone()))
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Sum of the sizes of the indexed valid checkpoints (as of the last scan).
    pub fn total_bytes(&self) -> u64 {
        self.usage().1
    }

    /// Number and total size of the indexed valid checkpoints (as of the last scan).
    pub fn usage(&self) -> (usize, u64) {
        let st = self.lock();
        let valid = st.files.values().filter_map(|s| s.result.as_ref().ok());
        valid.fold((0, 0), |(n, b), e| (n + 1, b + e.file_bytes))
    }

    /// Re-scan the directory (headers of new or changed files only).
    pub fn refresh(&self) -> Result<(), KvError> {
        let mut st = self.lock();
        self.scan(&mut st)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    // ------------------------------------------------------------------ index

    fn scan(&self, st: &mut State) -> Result<(), KvError> {
        let rd = fs::read_dir(&self.dir).map_err(|e| KvError::io("list", &self.dir, e))?;
        let proc_ok = Path::new("/proc/self").exists();
        let mut seen = HashSet::new();
        for ent in rd {
            let Ok(ent) = ent else { continue };
            let name = ent.file_name().to_string_lossy().into_owned();
            let path = ent.path();
            if let Some(pid) = parse_temp_name(&name) {
                self.consider_temp(st, &path, &name, pid, proc_ok);
                continue;
            }
            let Ok(meta) = ent.metadata() else { continue };
            if meta.is_dir() && parse_checkpoint_name(&name).is_none() {
                // A folder of its own (stored conversations): not the store's.
                continue;
            }
            let mut stamp = Stamp::of(&meta);
            seen.insert(name.clone());
            if st.files.get(&name).is_some_and(|s| s.stamp == stamp) {
                continue;
            }
            let result = match parse_checkpoint_name(&name) {
                None => Err(Defect::UnrecognizedName),
                Some(_) if !meta.file_type().is_file() => Err(Defect::NotRegularFile),
                Some(hash) => match index_file(&path, hash) {
                    // The stamp of the file read, which a writer may have
                    // renamed over the one listed.
                    Ok((read, r)) => {
                        stamp = read;
                        r
                    }
                    // Vanished or unreadable right now: try again at the next scan.
                    Err(_) => {
                        seen.remove(&name);
                        continue;
                    }
                },
            };
            record(st, &self.dir, name, Scanned { stamp, result });
        }
        st.files.retain(|n, _| seen.contains(n));
        Ok(())
    }

    fn consider_temp(&self, st: &mut State, path: &Path, name: &str, pid: u32, proc_ok: bool) {
        if st.in_flight.contains(name) {
            return;
        }
        let Ok(meta) = fs::symlink_metadata(path) else {
            return;
        };
        let age = meta
            .modified()
            .ok()
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .map_or(0, |d| d.as_secs());
        let dead = pid != std::process::id()
            && proc_ok
            && !Path::new("/proc").join(pid.to_string()).exists();
        let why = if dead {
            "its writer process is not running"
        } else if age >= STALE_TEMP_AGE_S {
            "older than 1 hour"
        } else {
            return; // a live process is writing it
        };
        if self.config.read_only {
            // Reported once per name, like a failed removal.
            if st.temp_failed.insert(name.to_string()) {
                st.notices.push(Notice::StaleTemp {
                    file: path.to_path_buf(),
                    why,
                });
            }
            return;
        }
        match fs::remove_file(path) {
            Ok(()) => st.notices.push(Notice::RemovedTemp {
                file: path.to_path_buf(),
                why,
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                if st.temp_failed.insert(name.to_string()) {
                    st.notices.push(Notice::TempRemoveFailed {
                        file: path.to_path_buf(),
                        error: e.to_string(),
                    });
                }
            }
        }
    }

    // ----------------------------------------------------------------- lookup

    fn compatible(&self, h: &Header, model: &ModelId, n_ctx: u32) -> Result<(), Mismatch> {
        match Mismatch::of(
            &h.model,
            h.n_ctx,
            model,
            n_ctx,
            self.config.reject_different_quant,
        ) {
            Some(m) => Err(m),
            None => Ok(()),
        }
    }

    /// The compatible checkpoint whose text shares the longest byte prefix with
    /// `prompt` without being a prefix of it: the near miss a lookup could not
    /// use, for explaining misses. Reads the texts (never the payloads).
    pub fn nearest_miss(
        &self,
        prompt: &[u8],
        model: &ModelId,
        n_ctx: u32,
    ) -> Result<Option<NearMiss>, KvError> {
        Ok(self
            .sharing(prompt, model, n_ctx, 1)?
            .into_iter()
            .next()
            .map(|s| NearMiss {
                path: s.candidate.path,
                tokens: s.candidate.header.tokens,
                common_bytes: s.common_bytes,
                text: s.text,
            }))
    }

    /// Every compatible checkpoint whose text shares at least `min_common`
    /// bytes with `prompt` without being a prefix of it, the most shared
    /// first (then the fewest tokens, the cheaper load): what a partial reuse
    /// may load ([`Store::load`] checks the shared bytes again). Reads the
    /// texts (never the payloads).
    pub fn sharing(
        &self,
        prompt: &[u8],
        model: &ModelId,
        n_ctx: u32,
        min_common: usize,
    ) -> Result<Vec<Shared>, KvError> {
        let live = {
            let mut st = self.lock();
            self.scan(&mut st)?;
            valid_entries(&st)
        };
        let mut found = Vec::new();
        for (name, e) in live {
            if self.compatible(&e.header, model, n_ctx).is_err() {
                continue;
            }
            let path = self.dir.join(&name);
            let Ok(file) = File::open(&path) else {
                continue;
            };
            let Ok(len) = usize::try_from(e.header.text_bytes) else {
                continue;
            };
            let mut text = vec![0u8; len];
            if file.read_exact_at(&mut text, HEADER_LEN as u64).is_err() {
                continue;
            }
            let common = text.iter().zip(prompt).take_while(|(a, b)| a == b).count();
            if common < text.len() && common >= min_common.max(1) {
                found.push(Shared {
                    candidate: Candidate {
                        hash: hex(&e.hash),
                        path,
                        header: e.header.clone(),
                        model: *model,
                        n_ctx,
                        shared: Some(common),
                    },
                    common_bytes: common,
                    text,
                });
            }
        }
        found.sort_by(|a, b| {
            b.common_bytes
                .cmp(&a.common_bytes)
                .then(a.candidate.header.tokens.cmp(&b.candidate.header.tokens))
                .then(a.candidate.path.cmp(&b.candidate.path))
        });
        Ok(found)
    }

    /// The longest checkpoint whose rendered text is a byte prefix of `prompt`, saved by
    /// this model (and quantization, when rejecting different quants) at a context no
    /// larger than `n_ctx`. Re-scans the directory (headers of new files only), then
    /// hashes the prompt once, incrementally, at each candidate text length.
    pub fn lookup(
        &self,
        prompt: &[u8],
        model: &ModelId,
        n_ctx: u32,
    ) -> Result<Option<Candidate>, KvError> {
        let found = self.longest_prefix(prompt, |h| self.compatible(h, model, n_ctx).is_ok())?;
        Ok(found.map(|(hash, path, header)| Candidate {
            hash,
            path,
            header,
            model: *model,
            n_ctx,
            shared: None,
        }))
    }

    /// The longest checkpoint whose text is a prefix of `prompt` that [`lookup`]
    /// turned away for `model` and `n_ctx`, with why (for explaining a miss).
    ///
    /// [`lookup`]: Store::lookup
    pub fn lookup_refused(
        &self,
        prompt: &[u8],
        model: &ModelId,
        n_ctx: u32,
    ) -> Result<Option<(PathBuf, Header, Mismatch)>, KvError> {
        let found = self.longest_prefix(prompt, |h| self.compatible(h, model, n_ctx).is_err())?;
        Ok(found.and_then(|(_, path, h)| {
            let why = self.compatible(&h, model, n_ctx).err()?;
            Some((path, h, why))
        }))
    }

    /// The longest entry that `keep` accepts whose text is a prefix of `prompt`:
    /// its hash, path and header.
    fn longest_prefix(
        &self,
        prompt: &[u8],
        keep: impl Fn(&Header) -> bool,
    ) -> Result<Option<(String, PathBuf, Header)>, KvError> {
        let mut st = self.lock();
        self.scan(&mut st)?;
        let mut cands: Vec<(&String, &Entry)> = st
            .files
            .iter()
            .filter_map(|(n, s)| s.result.as_ref().ok().map(|e| (n, e)))
            .filter(|(_, e)| e.header.text_bytes <= prompt.len() as u64 && keep(&e.header))
            .collect();
        cands.sort_by_key(|(_, e)| e.header.text_bytes);
        let mut hasher = Sha1::new();
        let mut hashed = 0usize;
        let mut best = None;
        for (name, e) in cands {
            let len = e.header.text_bytes as usize;
            hasher.update(&prompt[hashed..len]);
            hashed = len;
            let h: [u8; 20] = hasher.clone().finalize().into();
            if h == e.hash {
                best = Some((name, e));
            }
        }
        Ok(best.map(|(name, e)| {
            (
                name.trim_end_matches(".kv").to_string(),
                self.dir.join(name),
                e.header.clone(),
            )
        }))
    }

    // ------------------------------------------------------------------- load

    /// Read and verify the candidate fully (sizes, text hash = name, text = prefix of
    /// `prompt` — or, for a candidate from [`Store::sharing`], sharing exactly
    /// the bytes it shared then — body checksum, sections), then bump its hit count and last-used time in
    /// place. A damaged file is marked skipped and reported as [`KvError::Corrupt`].
    pub fn load(&self, cand: &Candidate, prompt: &[u8]) -> Result<Loaded, KvError> {
        let path = &cand.path;
        let open_rw = if self.config.read_only {
            Err(io::Error::from(io::ErrorKind::PermissionDenied))
        } else {
            OpenOptions::new().read(true).write(true).open(path)
        };
        let (file, writable) = match open_rw {
            Ok(f) => (f, true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(KvError::io("open", path, e))
            }
            Err(_) => (
                File::open(path).map_err(|e| KvError::io("open", path, e))?,
                false,
            ),
        };
        let hash = parse_hash(&cand.hash)
            .ok_or_else(|| KvError::InvalidRequest(format!("bad hash {:?}", cand.hash)))?;
        let res = read_checked(&file, &hash, Keep::All, |h| {
            self.compatible(h, &cand.model, cand.n_ctx)
                .map_err(|m| KvError::Changed {
                    path: path.clone(),
                    what: m.as_str(),
                })?;
            if cand.shared.is_none() && h.text_bytes > prompt.len() as u64 {
                return Err(KvError::Changed {
                    path: path.clone(),
                    what: "text longer than the prompt",
                });
            }
            Ok(())
        })
        .map_err(|e| KvError::io("read", path, e))?;
        let body = match res {
            Checked::Ok(b) => b,
            Checked::Rejected(e) => return Err(e),
            Checked::Bad(defect) => {
                self.mark_bad(&file, path, defect.clone());
                return Err(KvError::Corrupt {
                    path: path.clone(),
                    defect,
                });
            }
        };
        let common = body
            .text
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count();
        if common != cand.shared.unwrap_or(body.text.len()) {
            return Err(KvError::PrefixMismatch { path: path.clone() });
        }
        let mut header = body.header;
        header.hits = header.hits.saturating_add(1);
        header.last_used = now_unix();
        if writable {
            // Best effort: a failed usage update only affects eviction order.
            let _ = file.write_all_at(&header.usage_tail(), USAGE_OFFSET as u64);
        }
        let name = format!("{}.kv", cand.hash);
        if let Ok(meta) = file.metadata() {
            let mut st = self.lock();
            if let Some(s) = st.files.get_mut(&name) {
                if let Ok(e) = &mut s.result {
                    e.header = header.clone();
                    s.stamp = Stamp::of(&meta);
                }
            }
        }
        Ok(Loaded {
            header,
            text: body.text,
            payload: body.payload,
            sections: body.sections,
        })
    }

    fn mark_bad(&self, file: &File, path: &Path, defect: Defect) {
        let Ok(meta) = file.metadata() else { return };
        let Some(name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else {
            return;
        };
        let mut st = self.lock();
        st.files.insert(
            name,
            Scanned {
                stamp: Stamp::of(&meta),
                result: Err(defect),
            },
        );
    }

    // ------------------------------------------------------------------- save

    /// Save a checkpoint: budget pre-check, keep an existing compatible file, else
    /// write `<name>.tmp.<pid>` (0600), fsync, rename into place, fsync the directory,
    /// then evict down to the budget with the new file protected. On any I/O error the
    /// temp file is removed and the error returned; the store stays usable.
    pub fn save(&self, mut req: SaveRequest<'_>) -> Result<SaveOutcome, KvError> {
        self.writable()?;
        if req.tokens == 0 {
            return Err(KvError::InvalidRequest("tokens must be at least 1".into()));
        }
        if req.n_ctx < req.tokens {
            return Err(KvError::InvalidRequest(format!(
                "n_ctx {} is smaller than tokens {}",
                req.n_ctx, req.tokens
            )));
        }
        let hash = text_hash(req.text);
        let name = format!("{}.kv", hex(&hash));
        let path = self.dir.join(&name);
        let area = encode_sections(req.sections);
        let budget = self.config.budget_bytes;
        let estimate = (HEADER_LEN as u64)
            .saturating_add(req.text.len() as u64)
            .saturating_add(req.payload.estimated_bytes())
            .saturating_add(area.len() as u64);
        if estimate > budget {
            return Ok(SaveOutcome::Skipped(SkipReason::OverBudget {
                file_bytes: estimate,
                budget_bytes: budget,
            }));
        }
        let tmp_name = format!("{name}.tmp.{}", std::process::id());
        let tmp = self.dir.join(&tmp_name);
        let known_bad = {
            let mut st = self.lock();
            if !st.in_flight.insert(tmp_name.clone()) {
                return Ok(SaveOutcome::Skipped(SkipReason::InFlight));
            }
            st.files.get(&name).is_some_and(|s| s.result.is_err())
        };
        let res = self.save_unlocked(&mut req, &hash, &path, &tmp, &area, known_bad);
        let mut st = self.lock();
        st.in_flight.remove(&tmp_name);
        let outcome = res?;
        match &outcome {
            SaveOutcome::Saved { .. } | SaveOutcome::Kept { .. } => {
                if let Ok((stamp, Ok(entry))) = index_file(&path, hash) {
                    let result = Ok(entry);
                    st.files.insert(name.clone(), Scanned { stamp, result });
                }
                if matches!(outcome, SaveOutcome::Saved { .. }) {
                    self.evict_locked(&mut st, Some(&name), now_unix())?;
                }
            }
            SaveOutcome::Skipped(_) => {}
        }
        Ok(outcome)
    }

    fn save_unlocked(
        &self,
        req: &mut SaveRequest<'_>,
        hash: &[u8; 20],
        path: &Path,
        tmp: &Path,
        area: &[u8],
        known_bad: bool,
    ) -> Result<SaveOutcome, KvError> {
        let existing = fs::symlink_metadata(path).is_ok();
        if existing && !known_bad && self.existing_compatible(path, hash, req, area) {
            if let Ok(f) = OpenOptions::new().read(true).write(true).open(path) {
                if let Ok(Ok(mut h)) = read_header(&f) {
                    h.last_used = now_unix();
                    let _ = f.write_all_at(&h.usage_tail(), USAGE_OFFSET as u64);
                }
            }
            return Ok(SaveOutcome::Kept {
                path: path.to_path_buf(),
            });
        }
        let file_bytes = match write_temp(tmp, req, area) {
            Ok(n) => n,
            Err(e) => {
                let _ = fs::remove_file(tmp);
                return Err(e);
            }
        };
        if file_bytes > self.config.budget_bytes {
            let _ = fs::remove_file(tmp);
            return Ok(SaveOutcome::Skipped(SkipReason::OverBudget {
                file_bytes,
                budget_bytes: self.config.budget_bytes,
            }));
        }
        if let Err(e) = fs::rename(tmp, path) {
            let _ = fs::remove_file(tmp);
            return Err(KvError::io("rename temp file onto", path, e));
        }
        // Make the rename durable. Failure here leaves a valid file in place, so it is
        // not reported as a failed save.
        if let Ok(d) = File::open(&self.dir) {
            let _ = d.sync_all();
        }
        Ok(SaveOutcome::Saved {
            path: path.to_path_buf(),
            file_bytes,
            replaced: existing,
        })
    }

    /// Same text, same model (and quant when rejecting), context no larger than the
    /// request's, same extension flags and sections, and a sound header: keep it.
    fn existing_compatible(
        &self,
        path: &Path,
        hash: &[u8; 20],
        req: &SaveRequest<'_>,
        area: &[u8],
    ) -> bool {
        let Ok(file) = File::open(path) else {
            return false;
        };
        let Ok(meta) = file.metadata() else {
            return false;
        };
        let Ok(Ok(h)) = read_header(&file) else {
            return false;
        };
        if !meta.is_file()
            || h.file_bytes() != Some(meta.len())
            || self.compatible(&h, &req.model, req.n_ctx).is_err()
            || h.ext_flags != req.ext_flags
            || h.text_bytes != req.text.len() as u64
            || h.sections_bytes != area.len() as u64
        {
            return false;
        }
        let mut text = vec![0u8; req.text.len()];
        if file.read_exact_at(&mut text, HEADER_LEN as u64).is_err() || text != req.text {
            return false;
        }
        debug_assert_eq!(text_hash(&text), *hash);
        let mut stored = vec![0u8; area.len()];
        let off = HEADER_LEN as u64 + h.text_bytes + h.payload_bytes;
        file.read_exact_at(&mut stored, off).is_ok() && stored == area
    }

    // --------------------------------------------------------------- eviction

    /// Evict down to the budget now (also done by `open` and after each save).
    pub fn evict_to_budget(&self) -> Result<(), KvError> {
        self.writable()?;
        let mut st = self.lock();
        self.evict_locked(&mut st, None, now_unix())
    }

    fn evict_locked(
        &self,
        st: &mut State,
        protected: Option<&str>,
        now: u64,
    ) -> Result<(), KvError> {
        self.scan(st)?;
        let live = valid_entries(st);
        let mut total: u64 = live.iter().map(|(_, e)| e.file_bytes).sum();
        if total <= self.config.budget_bytes {
            return Ok(());
        }
        let pairs = superseded_pairs(&self.dir, &live);
        let mut alive = vec![true; live.len()];
        let mut stuck = vec![false; live.len()];
        while total > self.config.budget_bytes {
            let mut best: Option<(usize, f64)> = None;
            for (i, (name, e)) in live.iter().enumerate() {
                if !alive[i] || stuck[i] || Some(name.as_str()) == protected {
                    continue;
                }
                let sup = pairs.iter().any(|&(a, b)| a == i && alive[b]);
                let s = eviction_score(&e.header, e.file_bytes, sup, now);
                let better = match best {
                    None => true,
                    Some((j, bs)) => evict_cmp((s, e, name), (bs, &live[j].1, &live[j].0)).is_lt(),
                };
                if better {
                    best = Some((i, s));
                }
            }
            let Some((i, score)) = best else { break };
            let (name, e) = &live[i];
            let file = self.dir.join(name);
            match fs::remove_file(&file) {
                Ok(()) => {}
                Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                Err(err) => {
                    stuck[i] = true;
                    st.notices.push(Notice::EvictFailed {
                        file,
                        error: err.to_string(),
                    });
                    continue;
                }
            }
            alive[i] = false;
            total -= e.file_bytes;
            st.files.remove(name);
            st.notices.push(Notice::Evicted(Evicted {
                file,
                reason: e.header.reason,
                tokens: e.header.tokens,
                hits: e.header.hits,
                file_bytes: e.file_bytes,
                score,
            }));
        }
        Ok(())
    }

    // ------------------------------------------------------- ls, verify, remove

    /// All valid checkpoints in eviction order (first = next to go) with their score at
    /// `now` and a text excerpt. Re-scans the directory first.
    pub fn entries_at(&self, now: u64) -> Result<Vec<EntryInfo>, KvError> {
        let live = {
            let mut st = self.lock();
            self.scan(&mut st)?;
            valid_entries(&st)
        };
        let pairs = superseded_pairs(&self.dir, &live);
        let mut out: Vec<(EntryInfo, &Entry, &String)> = live
            .iter()
            .enumerate()
            .map(|(i, (name, e))| {
                let superseded = pairs.iter().any(|&(a, _)| a == i);
                let path = self.dir.join(name);
                let excerpt = read_excerpt(&path, e.header.text_bytes);
                let info = EntryInfo {
                    hash: name.trim_end_matches(".kv").to_string(),
                    path,
                    header: e.header.clone(),
                    file_bytes: e.file_bytes,
                    superseded,
                    score: eviction_score(&e.header, e.file_bytes, superseded, now),
                    excerpt,
                };
                (info, e, name)
            })
            .collect();
        out.sort_by(|a, b| evict_cmp((a.0.score, a.1, a.2), (b.0.score, b.1, b.2)));
        Ok(out.into_iter().map(|(i, _, _)| i).collect())
    }

    /// The extension sections of every valid checkpoint whose header has all of
    /// `flags`, read without the text and payload. Only the header checksum and
    /// the section framing are verified (the body checksum needs the whole file),
    /// so callers must treat the bytes as hints. Unreadable files are skipped.
    pub fn sections_with_flags(&self, flags: u32) -> Result<Vec<(PathBuf, Vec<Section>)>, KvError> {
        let live = {
            let mut st = self.lock();
            self.scan(&mut st)?;
            valid_entries(&st)
        };
        let mut out = Vec::new();
        for (name, e) in live {
            let h = &e.header;
            if h.ext_flags & flags != flags || h.sections_bytes == 0 {
                continue;
            }
            let path = self.dir.join(&name);
            let Ok(file) = File::open(&path) else {
                continue;
            };
            let Ok(len) = usize::try_from(h.sections_bytes) else {
                continue;
            };
            let mut area = vec![0u8; len];
            let offset = HEADER_LEN as u64 + h.text_bytes + h.payload_bytes;
            match read_full_at(&file, &mut area, offset) {
                Ok(n) if n == len => {}
                _ => continue,
            }
            if let Ok(sections) = decode_sections(&area) {
                out.push((path, sections));
            }
        }
        Ok(out)
    }

    /// [`entries_at`](Self::entries_at) the current time.
    pub fn entries(&self) -> Result<Vec<EntryInfo>, KvError> {
        self.entries_at(now_unix())
    }

    /// Fully read and checksum every checkpoint-named file; with `fix`, delete the bad
    /// ones (regular files only; unreadable files and foreign names are never touched).
    pub fn verify(&self, fix: bool) -> Result<VerifyReport, KvError> {
        if fix {
            self.writable()?;
        }
        let mut report = VerifyReport::default();
        let rd = fs::read_dir(&self.dir).map_err(|e| KvError::io("list", &self.dir, e))?;
        let mut names: Vec<(String, [u8; 20])> = rd
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let n = e.file_name().to_str()?.to_string();
                let h = parse_checkpoint_name(&n)?;
                Some((n, h))
            })
            .collect();
        names.sort();
        for (name, hash) in names {
            let path = self.dir.join(&name);
            let res = match fs::symlink_metadata(&path) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => Err(e),
                Ok(m) if !m.is_file() => Ok(Err(Defect::NotRegularFile)),
                Ok(_) => File::open(&path).and_then(|f| {
                    read_checked(&f, &hash, Keep::None, |_| Ok(())).map(|c| match c {
                        Checked::Ok(_) => Ok(()),
                        Checked::Bad(d) => Err(d),
                        Checked::Rejected(_) => unreachable!("verify accepts every header"),
                    })
                }),
            };
            report.checked += 1;
            match res {
                Ok(Ok(())) => report.ok += 1,
                Ok(Err(defect)) => {
                    if fix && defect != Defect::NotRegularFile && fs::remove_file(&path).is_ok() {
                        report.removed.push(path.clone());
                    }
                    report.bad.push((path, defect));
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => report.checked -= 1,
                Err(e) => report.unreadable.push((path, e.to_string())),
            }
        }
        let mut st = self.lock();
        self.scan(&mut st)?;
        Ok(report)
    }

    /// Delete one checkpoint by its 40-hex-digit hash. `Ok(false)` if it was not there.
    pub fn remove(&self, hash: &str) -> Result<bool, KvError> {
        self.writable()?;
        if parse_hash(hash).is_none() {
            return Err(KvError::InvalidRequest(format!(
                "{hash:?} is not 40 lowercase hex digits"
            )));
        }
        let name = format!("{hash}.kv");
        let path = self.dir.join(&name);
        let removed = match fs::remove_file(&path) {
            Ok(()) => true,
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => return Err(KvError::io("remove", &path, e)),
        };
        self.lock().files.remove(&name);
        Ok(removed)
    }

    /// Delete every checkpoint-named regular file (valid or not). Returns how many.
    pub fn clear(&self) -> Result<usize, KvError> {
        self.writable()?;
        let rd = fs::read_dir(&self.dir).map_err(|e| KvError::io("list", &self.dir, e))?;
        let mut n = 0;
        for ent in rd.filter_map(|e| e.ok()) {
            let name = ent.file_name();
            let Some(name) = name.to_str() else { continue };
            if parse_checkpoint_name(name).is_none() || !ent.file_type().is_ok_and(|t| t.is_file())
            {
                continue;
            }
            match fs::remove_file(ent.path()) {
                Ok(()) => n += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(KvError::io("remove", ent.path(), e)),
            }
        }
        let mut st = self.lock();
        self.scan(&mut st)?;
        Ok(n)
    }
}

/// Queue a notice when a name newly becomes bad (or bad for another reason).
fn record(st: &mut State, dir: &Path, name: String, s: Scanned) {
    if let Err(d) = &s.result {
        let same = st
            .files
            .get(&name)
            .is_some_and(|old| old.result.as_ref().err() == Some(d));
        if !same {
            st.notices.push(Notice::Skipped {
                file: dir.join(&name),
                defect: d.clone(),
            });
        }
    }
    st.files.insert(name, s);
}

fn valid_entries(st: &State) -> Vec<(String, Entry)> {
    let mut v: Vec<_> = st
        .files
        .iter()
        .filter_map(|(n, s)| s.result.as_ref().ok().map(|e| (n.clone(), e.clone())))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Eviction order: lower score first; ties → older use first; then name.
fn evict_cmp(a: (f64, &Entry, &String), b: (f64, &Entry, &String)) -> std::cmp::Ordering {
    a.0.total_cmp(&b.0)
        .then(a.1.header.used_at().cmp(&b.1.header.used_at()))
        .then(a.2.cmp(b.2))
}

/// Pairs `(i, j)`: entry `i` is a waypoint (`continued`, `turn-end`, `agent-session`) checkpoint whose text is a strict prefix
/// of entry `j`'s text, `j` has the same model fingerprint and was created no earlier.
/// Reads the text of each possible extender once, hashing it incrementally.
fn superseded_pairs(dir: &Path, live: &[(String, Entry)]) -> Vec<(usize, usize)> {
    let mut pairs = Vec::new();
    let conts: Vec<usize> = (0..live.len())
        .filter(|&i| live[i].1.header.reason.is_waypoint())
        .collect();
    if conts.is_empty() {
        return pairs;
    }
    for (j, (name, n)) in live.iter().enumerate() {
        let mut need: Vec<usize> = conts
            .iter()
            .copied()
            .filter(|&i| {
                let e = &live[i].1.header;
                i != j
                    && e.model.model_fp == n.header.model.model_fp
                    && e.text_bytes < n.header.text_bytes
                    && e.created <= n.header.created
            })
            .collect();
        if need.is_empty() {
            continue;
        }
        need.sort_by_key(|&i| live[i].1.header.text_bytes);
        let max = live[*need.last().expect("non-empty")].1.header.text_bytes as usize;
        let mut text = vec![0u8; max];
        let Ok(f) = File::open(dir.join(name)) else {
            continue;
        };
        if f.read_exact_at(&mut text, HEADER_LEN as u64).is_err() {
            continue;
        }
        let mut hasher = Sha1::new();
        let mut hashed = 0usize;
        for i in need {
            let len = live[i].1.header.text_bytes as usize;
            hasher.update(&text[hashed..len]);
            hashed = len;
            let h: [u8; 20] = hasher.clone().finalize().into();
            if h == live[i].1.hash {
                pairs.push((i, j));
            }
        }
    }
    pairs
}

fn read_excerpt(path: &Path, text_bytes: u64) -> String {
    let n = text_bytes.min(4 * EXCERPT_CHARS as u64) as usize;
    let mut buf = vec![0u8; n];
    let Ok(f) = File::open(path) else {
        return String::new();
    };
    if f.read_exact_at(&mut buf, HEADER_LEN as u64).is_err() {
        return String::new();
    }
    String::from_utf8_lossy(&buf)
        .chars()
        .take(EXCERPT_CHARS)
        .collect()
}

// ------------------------------------------------------------------ file I/O

/// Read the header at offset 0. A header-checksum mismatch is re-read once: another
/// process may have been rewriting the usage tail at that moment.
fn read_header(f: &File) -> io::Result<Result<Header, Defect>> {
    let mut buf = [0u8; HEADER_LEN];
    let mut first = true;
    loop {
        let n = read_full_at(f, &mut buf, 0)?;
        match Header::decode(&buf[..n]) {
            Err(Defect::HeaderChecksum { .. }) if first => first = false,
            r => return Ok(r),
        }
    }
}

fn read_full_at(f: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read_at(&mut buf[n..], offset + n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Index one file from its header, with the stamp of the file read (its size
/// and header from one open file: a save renames a new file over the name at
/// any moment): `Ok(Err(defect))` for a bad file, `Err` for I/O.
fn index_file(path: &Path, hash: [u8; 20]) -> io::Result<(Stamp, Result<Entry, Defect>)> {
    let f = File::open(path)?;
    let meta = f.metadata()?;
    let (stamp, len) = (Stamp::of(&meta), meta.len());
    if len == 0 {
        return Ok((stamp, Err(Defect::Empty)));
    }
    let header = match read_header(&f)? {
        Ok(h) => h,
        Err(d) => return Ok((stamp, Err(d))),
    };
    let expected = header.file_bytes().expect("checked by decode");
    if expected != len {
        return Ok((
            stamp,
            Err(Defect::SizeMismatch {
                actual: len,
                expected,
            }),
        ));
    }
    let entry = Entry {
        hash,
        header,
        file_bytes: len,
    };
    Ok((stamp, Ok(entry)))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Keep {
    All,
    None,
}

struct Body {
    header: Header,
    text: Vec<u8>,
    payload: Vec<u8>,
    sections: Vec<Section>,
}

enum Checked {
    Ok(Body),
    Bad(Defect),
    Rejected(KvError),
}

/// Fully read and verify one file. `accept` may reject a sound header (compatibility)
/// before the body is read.
fn read_checked(
    f: &File,
    hash: &[u8; 20],
    keep: Keep,
    accept: impl FnOnce(&Header) -> Result<(), KvError>,
) -> io::Result<Checked> {
    let len = f.metadata()?.len();
    if len == 0 {
        return Ok(Checked::Bad(Defect::Empty));
    }
    let header = match read_header(f)? {
        Ok(h) => h,
        Err(d) => return Ok(Checked::Bad(d)),
    };
    let expected = header.file_bytes().expect("checked by decode");
    if expected != len {
        return Ok(Checked::Bad(Defect::SizeMismatch {
            actual: len,
            expected,
        }));
    }
    if let Err(e) = accept(&header) {
        return Ok(Checked::Rejected(e));
    }
    let shrunk = |f: &File| -> io::Result<Checked> {
        Ok(Checked::Bad(Defect::SizeMismatch {
            actual: f.metadata()?.len(),
            expected,
        }))
    };
    let mut r = ReadAt {
        f,
        pos: HEADER_LEN as u64,
    };
    let mut sum = Xxh3::new();
    let text = match read_hashed(&mut r, header.text_bytes, &mut sum, true) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return shrunk(f),
        Err(e) => return Err(e),
    };
    let computed = text_hash(&text);
    if computed != *hash {
        return Ok(Checked::Bad(Defect::TextHash {
            computed: hex(&computed),
        }));
    }
    let payload = match read_hashed(&mut r, header.payload_bytes, &mut sum, keep == Keep::All) {
        Ok(p) => p,
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return shrunk(f),
        Err(e) => return Err(e),
    };
    let area = match read_hashed(&mut r, header.sections_bytes, &mut sum, true) {
        Ok(a) => a,
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return shrunk(f),
        Err(e) => return Err(e),
    };
    let computed = sum.digest();
    if computed != header.body_checksum {
        return Ok(Checked::Bad(Defect::BodyChecksum {
            stored: header.body_checksum,
            computed,
        }));
    }
    let sections = match decode_sections(&area) {
        Ok(s) => s,
        Err(d) => return Ok(Checked::Bad(d)),
    };
    Ok(Checked::Ok(Body {
        header,
        text,
        payload,
        sections,
    }))
}

/// Sequential reads through positioned I/O, so header re-reads never move a cursor.
struct ReadAt<'a> {
    f: &'a File,
    pos: u64,
}

impl Read for ReadAt<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.f.read_at(buf, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

/// Read `len` bytes in [`IO_CHUNK`] pieces, hashing each piece while it is hot.
/// With `keep == false` the bytes are hashed and dropped (verify).
fn read_hashed(r: &mut impl Read, len: u64, sum: &mut Xxh3, keep: bool) -> io::Result<Vec<u8>> {
    let len = usize::try_from(len).map_err(|_| io::Error::other("length exceeds usize"))?;
    if keep {
        let mut v = Vec::with_capacity(len);
        while v.len() < len {
            let start = v.len();
            let n = (len - start).min(IO_CHUNK);
            v.resize(start + n, 0);
            r.read_exact(&mut v[start..])?;
            sum.update(&v[start..]);
        }
        Ok(v)
    } else {
        let mut buf = vec![0u8; len.min(IO_CHUNK)];
        let mut left = len;
        while left > 0 {
            let n = left.min(IO_CHUNK);
            r.read_exact(&mut buf[..n])?;
            sum.update(&buf[..n]);
            left -= n;
        }
        Ok(Vec::new())
    }
}

/// Hashes and counts what passes through (text, payload, sections; not the header).
struct HashingWriter<W: Write> {
    inner: W,
    sum: Xxh3,
    count: u64,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.sum.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Write the whole temp file and fsync it. Returns its size.
fn write_temp(tmp: &Path, req: &mut SaveRequest<'_>, area: &[u8]) -> Result<u64, KvError> {
    let create = || {
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(tmp)
    };
    let file = match create() {
        // Not ours (ours are tracked in flight): a leftover of a dead process that had
        // our pid. Replace it.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            let _ = fs::remove_file(tmp);
            create()
        }
        r => r,
    }
    .map_err(|e| KvError::io("create temp file", tmp, e))?;
    let werr = |e| KvError::io("write temp file", tmp, e);
    let mut w = HashingWriter {
        inner: BufWriter::with_capacity(IO_CHUNK, file),
        sum: Xxh3::new(),
        count: 0,
    };
    // Placeholder header; the real one is written last, once sizes and sum are known.
    w.inner.write_all(&[0u8; HEADER_LEN]).map_err(werr)?;
    for chunk in req.text.chunks(IO_CHUNK) {
        w.write_all(chunk).map_err(werr)?;
    }
    let text_end = w.count;
    match &mut req.payload {
        Payload::Bytes(b) => {
            for chunk in b.chunks(IO_CHUNK) {
                w.write_all(chunk).map_err(werr)?;
            }
        }
        Payload::Stream { write, .. } => {
            write(&mut w).map_err(|e| KvError::io("write payload to", tmp, e))?;
        }
    }
    let payload_bytes = w.count - text_end;
    w.write_all(area).map_err(werr)?;
    let body_bytes = w.count;
    let body_checksum = w.sum.digest();
    let file = w.inner.into_inner().map_err(|e| werr(e.into_error()))?;
    let now = now_unix();
    let header = Header {
        reason: req.reason,
        ext_flags: req.ext_flags,
        tokens: req.tokens,
        hits: 0,
        n_ctx: req.n_ctx,
        created: now,
        last_used: now,
        text_bytes: req.text.len() as u64,
        payload_bytes,
        sections_bytes: area.len() as u64,
        model: req.model,
        body_checksum,
    };
    debug_assert_eq!(FORMAT_VERSION, header.encode()[3]);
    file.write_all_at(&header.encode(), 0).map_err(werr)?;
    file.sync_all()
        .map_err(|e| KvError::io("fsync temp file", tmp, e))?;
    Ok(HEADER_LEN as u64 + body_bytes)
}
