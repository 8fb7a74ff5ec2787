//! Counters for `GET /metrics`, in the Prometheus text format. Updated by the
//! HTTP side (requests by route and status) and by the runtime's notices
//! (tokens, seconds, queue wait, cache hits); the checkpoint store and the
//! slots are read from the runtime at each scrape.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use ds4_runtime::{CacheSource, SlotInfo, StoreUsage};

#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    draft_tokens: AtomicU64,
    accepted_draft_tokens: AtomicU64,
    prefill_micros: AtomicU64,
    decode_micros: AtomicU64,
    queue_micros: AtomicU64,
    /// Indexed like [`SOURCES`].
    cache_hits: [AtomicU64; 5],
    kv_files: AtomicU64,
    kv_bytes: AtomicU64,
    kv_evictions: AtomicU64,
    kv_save_failures: AtomicU64,
    connections_refused: AtomicU64,
}

const SOURCES: [CacheSource; 5] = [
    CacheSource::MemoryToken,
    CacheSource::MemoryText,
    CacheSource::DiskText,
    CacheSource::DiskTextPartial,
    CacheSource::None,
];

/// What one finished generation adds.
pub struct JobStats {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    /// Draft tokens its decoding steps carried, and those kept.
    pub draft_tokens: usize,
    pub accepted_draft_tokens: usize,
    pub prefill_s: f64,
    pub decode_s: f64,
    /// Seconds it waited for a slot.
    pub queue_s: f64,
    pub source: CacheSource,
}

impl Metrics {
    /// Counts one answered request. Routes outside the API are folded into
    /// `other` so a scanner cannot grow the table.
    pub fn request(&self, route: &str, status: u16) {
        const ROUTES: &[&str] = &[
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/messages",
            "/v1/messages/count_tokens",
            "/v1/responses",
            "/v1/models",
            "/tokenize",
            "/detokenize",
            "/apply-template",
            "/health",
            "/metrics",
        ];
        let route = if ROUTES.contains(&route) {
            route
        } else {
            "other"
        };
        let mut m = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((route.to_string(), status)).or_insert(0) += 1;
    }

    pub fn job(&self, s: &JobStats) {
        self.prompt_tokens
            .fetch_add(s.prompt_tokens as u64, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(s.cached_tokens as u64, Ordering::Relaxed);
        self.generated_tokens
            .fetch_add(s.generated_tokens as u64, Ordering::Relaxed);
        self.draft_tokens
            .fetch_add(s.draft_tokens as u64, Ordering::Relaxed);
        self.accepted_draft_tokens
            .fetch_add(s.accepted_draft_tokens as u64, Ordering::Relaxed);
        self.prefill_micros
            .fetch_add((s.prefill_s * 1e6) as u64, Ordering::Relaxed);
        self.decode_micros
            .fetch_add((s.decode_s * 1e6) as u64, Ordering::Relaxed);
        self.queue_micros
            .fetch_add((s.queue_s * 1e6) as u64, Ordering::Relaxed);
        if let Some(i) = SOURCES.iter().position(|&x| x == s.source) {
            self.cache_hits[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The checkpoint store's current size, its evictions and failed saves so far.
    pub fn store(&self, u: &StoreUsage) {
        self.kv_files.store(u.files as u64, Ordering::Relaxed);
        self.kv_bytes.store(u.bytes, Ordering::Relaxed);
        self.kv_evictions.store(u.evictions, Ordering::Relaxed);
        self.kv_save_failures
            .store(u.save_failures, Ordering::Relaxed);
    }

    /// Counts a connection refused at the connection cap; returns the count.
    pub fn connection_refused(&self) -> u64 {
        self.connections_refused.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The Prometheus text exposition, with the runtime's queue depth and
    /// slots.
    pub fn render(&self, queue_depth: usize, slots: &[SlotInfo]) -> String {
        let mut out = String::new();
        let mut family = |name: &str, kind: &str, help: &str| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        family(
            "ds4_requests_total",
            "counter",
            "HTTP requests answered, by route and status.",
        );
        let requests = self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut lines = String::new();
        for ((route, status), n) in &requests {
            let _ = writeln!(
                lines,
                "ds4_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        out.push_str(&lines);
        let counter = |out: &mut String, name: &str, help: &str, v: String| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        counter(
            &mut out,
            "ds4_prompt_tokens_total",
            "Prompt tokens of finished generations.",
            load(&self.prompt_tokens).to_string(),
        );
        counter(
            &mut out,
            "ds4_cached_tokens_total",
            "Prompt tokens reused instead of prefilled.",
            load(&self.cached_tokens).to_string(),
        );
        counter(
            &mut out,
            "ds4_generated_tokens_total",
            "Tokens generated.",
            load(&self.generated_tokens).to_string(),
        );
        counter(
            &mut out,
            "ds4_draft_tokens_total",
            "Draft tokens verified by speculative decoding steps.",
            load(&self.draft_tokens).to_string(),
        );
        counter(
            &mut out,
            "ds4_draft_accepted_tokens_total",
            "Draft tokens kept (each saved a decoding step).",
            load(&self.accepted_draft_tokens).to_string(),
        );
        counter(
            &mut out,
            "ds4_prefill_seconds_total",
            "Seconds spent prefilling.",
            format!("{:.6}", load(&self.prefill_micros) as f64 / 1e6),
        );
        counter(
            &mut out,
            "ds4_decode_seconds_total",
            "Seconds spent generating.",
            format!("{:.6}", load(&self.decode_micros) as f64 / 1e6),
        );
        counter(
            &mut out,
            "ds4_queue_wait_seconds_total",
            "Seconds requests waited for a slot.",
            format!("{:.6}", load(&self.queue_micros) as f64 / 1e6),
        );
        let _ = writeln!(out, "# HELP ds4_cache_hits_total Generations by where their reused state came from.\n# TYPE ds4_cache_hits_total counter");
        for (s, n) in SOURCES.iter().zip(&self.cache_hits) {
            let _ = writeln!(
                out,
                "ds4_cache_hits_total{{source=\"{}\"}} {}",
                s.as_str(),
                load(n)
            );
        }
        let gauge = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        gauge(
            &mut out,
            "ds4_kv_store_files",
            "Checkpoint files in the disk store.",
            load(&self.kv_files),
        );
        gauge(
            &mut out,
            "ds4_kv_store_bytes",
            "Bytes of checkpoint files in the disk store.",
            load(&self.kv_bytes),
        );
        counter(
            &mut out,
            "ds4_kv_store_evictions_total",
            "Checkpoints evicted to stay under budget.",
            load(&self.kv_evictions).to_string(),
        );
        counter(
            &mut out,
            "ds4_kv_store_save_failures_total",
            "Checkpoint saves that failed (full disk, permissions, I/O errors).",
            load(&self.kv_save_failures).to_string(),
        );
        counter(
            &mut out,
            "ds4_connections_refused_total",
            "Connections refused at --max-connections.",
            load(&self.connections_refused).to_string(),
        );
        gauge(
            &mut out,
            "ds4_queue_depth",
            "Requests queued or running.",
            queue_depth as u64,
        );
        for (name, help, kind, value) in [
            (
                "ds4_slot_busy",
                "Whether the slot runs a request.",
                "gauge",
                &(|s: &SlotInfo| u64::from(s.busy).to_string()) as &dyn Fn(&SlotInfo) -> String,
            ),
            (
                "ds4_slot_tokens",
                "Tokens the slot's session holds.",
                "gauge",
                &|s: &SlotInfo| s.tokens.to_string(),
            ),
            (
                "ds4_slot_idle_seconds",
                "Seconds since the slot's last request ended.",
                "gauge",
                &|s: &SlotInfo| format!("{:.3}", s.idle_s),
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for s in slots {
                let _ = writeln!(out, "{name}{{slot=\"{}\"}} {}", s.id, value(s));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_every_family() {
        let m = Metrics::default();
        m.request("/v1/chat/completions", 200);
        m.request("/v1/chat/completions", 200);
        m.request("/wp-admin", 404);
        m.job(&JobStats {
            prompt_tokens: 10,
            cached_tokens: 4,
            generated_tokens: 3,
            draft_tokens: 7,
            accepted_draft_tokens: 2,
            prefill_s: 0.5,
            decode_s: 0.25,
            queue_s: 0.125,
            source: CacheSource::MemoryText,
        });
        m.store(&StoreUsage {
            files: 2,
            bytes: 1000,
            evictions: 1,
            save_failures: 4,
        });
        m.connection_refused();
        let slot = SlotInfo {
            id: 1,
            busy: true,
            tokens: 42,
            n_ctx: 4096,
            text_sha1: [0; 20],
            idle_s: 0.0,
            state_bytes: 0,
        };
        let t = m.render(3, &[slot]);
        for line in [
            "ds4_requests_total{route=\"/v1/chat/completions\",status=\"200\"} 2",
            "ds4_requests_total{route=\"other\",status=\"404\"} 1",
            "ds4_prompt_tokens_total 10",
            "ds4_cached_tokens_total 4",
            "ds4_generated_tokens_total 3",
            "ds4_draft_tokens_total 7",
            "ds4_draft_accepted_tokens_total 2",
            "ds4_prefill_seconds_total 0.500000",
            "ds4_cache_hits_total{source=\"memory-text\"} 1",
            "ds4_cache_hits_total{source=\"none\"} 0",
            "ds4_cache_hits_total{source=\"disk-text-partial\"} 0",
            "ds4_kv_store_files 2",
            "ds4_kv_store_bytes 1000",
            "ds4_kv_store_evictions_total 1",
            "ds4_kv_store_save_failures_total 4",
            "ds4_connections_refused_total 1",
            "ds4_queue_depth 3",
            "ds4_queue_wait_seconds_total 0.125000",
            "ds4_slot_busy{slot=\"1\"} 1",
            "ds4_slot_tokens{slot=\"1\"} 42",
        ] {
            assert!(t.lines().any(|l| l == line), "{line:?} missing from\n{t}");
        }
    }
}
