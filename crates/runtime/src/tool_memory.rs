//! The exact-replay memory of tool calls: call id -> the text the model sampled
//! for that call's turn, so resent history renders byte-identically to the live
//! state (and its reuse holds). The turns a checkpoint's text contains are saved
//! with it, and ids the memory does not know (after a restart) are looked up in
//! the checkpoints' sections.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use ds4_chat::{Message, Role};
use ds4_kvstore::{Section, Store, EXT_TOOL_ID_MAP};
use serde_json::{json, Value};

/// Section kind of the tool-id map in a checkpoint (flag [`EXT_TOOL_ID_MAP`]).
pub const SECTION_TOOL_IDS: u32 = 1;

/// Turns of the memory a checkpoint save looks at, newest first.
const SAVE_SCAN_TURNS: usize = 1024;

/// How a request's history tool calls were rendered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayStats {
    /// Assistant turns rendered from the exact sampled text.
    pub exact: usize,
    /// Assistant turns rendered canonically (unknown ids, or replay disabled).
    pub canonical: usize,
}

/// Call id -> the exact text the model sampled for that call's turn (everything
/// after the content), bounded by a count with least-recently-used eviction.
/// Every id of a turn maps to the same shared text. The turns a checkpoint's text
/// contains are saved with it (a section), and ids the memory does not know — after
/// a restart — are looked up in the checkpoints' sections.
pub struct ToolMemory {
    max_ids: usize,
    inner: Mutex<Lru>,
    disk: Option<DiskLookup>,
}

/// Where unknown ids are looked up, and the store usage (files, bytes) at the
/// last scan: a scan is repeated only when the store changed.
struct DiskLookup {
    store: Store,
    scanned_at: Mutex<Option<(usize, u64)>>,
}

#[derive(Default)]
struct Lru {
    tick: u64,
    entries: HashMap<String, (Arc<str>, u64)>,
    by_age: BTreeMap<u64, String>,
}

impl Lru {
    fn touch(&mut self, id: &str) -> Option<Arc<str>> {
        self.tick += 1;
        let tick = self.tick;
        let (text, used) = self.entries.get_mut(id)?;
        self.by_age.remove(used);
        *used = tick;
        self.by_age.insert(tick, id.to_string());
        Some(Arc::clone(text))
    }
}

impl ToolMemory {
    /// A memory of at most `max_ids` ids (0 disables exact replay), looking up
    /// unknown ids in `disk`'s checkpoints.
    pub fn new(max_ids: usize, disk: Option<Store>) -> Self {
        ToolMemory {
            max_ids,
            inner: Mutex::new(Lru::default()),
            disk: disk.filter(|_| max_ids > 0).map(|store| DiskLookup {
                store,
                scanned_at: Mutex::new(None),
            }),
        }
    }

    /// The turns of the memory whose text occurs in `text` (a checkpoint's),
    /// as the checkpoint section that carries them; `None` if there are none.
    pub fn section_for(&self, text: &str) -> Option<Section> {
        let m = self.inner.lock().ok()?;
        let mut by_text: Vec<(Arc<str>, Vec<&str>)> = Vec::new();
        for id in m.by_age.values().rev() {
            if by_text.len() == SAVE_SCAN_TURNS {
                break;
            }
            let Some((t, _)) = m.entries.get(id) else {
                continue;
            };
            match by_text.iter().position(|(k, _)| Arc::ptr_eq(k, t)) {
                Some(i) => by_text[i].1.push(id),
                None => by_text.push((Arc::clone(t), vec![id])),
            }
        }
        let turns: Vec<Value> = by_text
            .iter()
            .filter(|(t, _)| text.contains(&**t))
            .map(|(t, ids)| json!({ "ids": ids, "text": &**t }))
            .collect();
        (!turns.is_empty()).then(|| Section {
            kind: SECTION_TOOL_IDS,
            bytes: Value::Array(turns).to_string().into_bytes(),
        })
    }

    /// Remembers the turns of a checkpoint section. Malformed sections are
    /// ignored: they are hints.
    pub fn load_section(&self, bytes: &[u8]) {
        let Ok(Value::Array(turns)) = serde_json::from_slice::<Value>(bytes) else {
            return;
        };
        for turn in turns {
            let (Some(ids), Some(text)) = (turn["ids"].as_array(), turn["text"].as_str()) else {
                continue;
            };
            let ids: Vec<String> = ids
                .iter()
                .filter_map(|i| i.as_str().map(String::from))
                .collect();
            self.remember(&ids, text);
        }
    }

    /// Loads the turns of every checkpoint on disk, when the store changed since
    /// the last scan (a scan loads them all, so an unchanged store has nothing
    /// new; the memory's bound still holds).
    fn load_from_disk(&self) {
        let Some(DiskLookup { store, scanned_at }) = &self.disk else {
            return;
        };
        let usage = store.usage();
        let Ok(mut last) = scanned_at.lock() else {
            return;
        };
        if *last == Some(usage) {
            return;
        }
        *last = Some(usage);
        let Ok(found) = store.sections_with_flags(EXT_TOOL_ID_MAP) else {
            return;
        };
        for (_, sections) in found {
            for s in sections.iter().filter(|s| s.kind == SECTION_TOOL_IDS) {
                self.load_section(&s.bytes);
            }
        }
    }

    /// Remembers `raw` as the exact text of the turn whose calls have `ids`.
    pub fn remember(&self, ids: &[String], raw: &str) {
        if self.max_ids == 0 || ids.is_empty() {
            return;
        }
        let text: Arc<str> = Arc::from(raw);
        let Ok(mut m) = self.inner.lock() else { return };
        for id in ids {
            m.tick += 1;
            let tick = m.tick;
            if let Some((_, old)) = m.entries.insert(id.clone(), (Arc::clone(&text), tick)) {
                m.by_age.remove(&old);
            }
            m.by_age.insert(tick, id.clone());
        }
        while m.entries.len() > self.max_ids {
            let Some((_, oldest)) = m.by_age.pop_first() else {
                break;
            };
            m.entries.remove(&oldest);
        }
    }

    /// The remembered text of a turn, if every id is known and all map to the
    /// same turn.
    pub fn lookup(&self, ids: &[&str]) -> Option<Arc<str>> {
        let mut m = self.inner.lock().ok()?;
        let mut found: Option<Arc<str>> = None;
        for id in ids {
            let text = m.touch(id)?;
            match &found {
                Some(f) if !Arc::ptr_eq(f, &text) && **f != *text => return None,
                _ => found = Some(text),
            }
        }
        found
    }

    /// Sets `tool_calls_raw` on every history assistant turn whose calls are all
    /// remembered as one turn.
    pub fn attach(&self, messages: &mut [Message]) -> ReplayStats {
        if self.disk.is_some() {
            let any_unknown = self.inner.lock().is_ok_and(|m| {
                messages
                    .iter()
                    .flat_map(|m| &m.tool_calls)
                    .any(|c| !m.entries.contains_key(&c.id))
            });
            if any_unknown {
                self.load_from_disk();
            }
        }
        let mut stats = ReplayStats::default();
        for m in messages
            .iter_mut()
            .filter(|m| m.role == Role::Assistant && !m.tool_calls.is_empty())
        {
            let ids: Vec<&str> = m.tool_calls.iter().map(|c| c.id.as_str()).collect();
            match self.lookup(&ids) {
                Some(raw) => {
                    m.tool_calls_raw = Some(raw.to_string());
                    stats.exact += 1;
                }
                None => stats.canonical += 1,
            }
        }
        stats
    }

    pub fn id_count(&self) -> usize {
        self.inner.lock().map_or(0, |m| m.entries.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_chat::ToolCall;

    #[test]
    fn memory_replays_whole_turns_and_evicts_the_least_recently_used() {
        let mem = ToolMemory::new(3, None);
        mem.remember(&["a".into(), "b".into()], "\nTURN1");
        mem.remember(&["c".into()], "\nTURN2");
        assert_eq!(mem.lookup(&["a", "b"]).as_deref(), Some("\nTURN1"));
        assert_eq!(mem.lookup(&["a", "c"]), None, "ids of different turns");
        assert_eq!(mem.lookup(&["a", "x"]), None, "an unknown id");
        // Lookups touch what they find: "b" is now the least recently used.
        mem.remember(&["d".into()], "\nTURN3");
        assert_eq!(mem.id_count(), 3);
        assert_eq!(mem.lookup(&["b"]), None);
        assert!(mem.lookup(&["c"]).is_some() && mem.lookup(&["d"]).is_some());

        let mut msgs = vec![
            Message::new(Role::User, "q"),
            Message {
                role: Role::Assistant,
                tool_calls: vec![
                    ToolCall {
                        id: "a".into(),
                        name: "f".into(),
                        arguments: "{}".into(),
                    },
                    ToolCall {
                        id: "b".into(),
                        name: "f".into(),
                        arguments: "{}".into(),
                    },
                ],
                ..Default::default()
            },
            Message {
                role: Role::Assistant,
                tool_calls: vec![ToolCall {
                    id: "zz".into(),
                    ..Default::default()
                }],
                ..Default::default()
            },
        ];
        mem.remember(&["a".into(), "b".into()], "\nTURN1");
        let stats = mem.attach(&mut msgs);
        assert_eq!(
            stats,
            ReplayStats {
                exact: 1,
                canonical: 1
            }
        );
        assert_eq!(msgs[1].tool_calls_raw.as_deref(), Some("\nTURN1"));
        assert_eq!(msgs[2].tool_calls_raw, None);

        // The turns a checkpoint contains travel with it, and come back.
        let section = mem.section_for("prefix\nTURN1<|im_end|>").unwrap();
        assert_eq!(section.kind, SECTION_TOOL_IDS);
        assert!(mem.section_for("no turn here").is_none());
        let fresh = ToolMemory::new(10, None);
        fresh.load_section(&section.bytes);
        assert_eq!(fresh.lookup(&["a", "b"]).as_deref(), Some("\nTURN1"));
        fresh.load_section(b"{not json");
        fresh.load_section(br#"[{"ids":"x"}]"#);
        assert_eq!(fresh.id_count(), 2);

        let off = ToolMemory::new(0, None);
        off.remember(&["a".into()], "x");
        assert_eq!(off.id_count(), 0);
    }
}
