//! What the server does with the runtime's notices: one log line each on
//! stderr, the trace's `cache` and `request` records (`--trace`), and the
//! per-request counters of `/metrics`.

use std::sync::Arc;

use ds4_runtime::{Notice, NoticeSink};
use serde_json::json;

use crate::metrics::{JobStats, Metrics};
use crate::trace::Trace;

/// The sink `ds4 serve` gives its runtime.
pub fn sink(metrics: Arc<Metrics>, trace: Option<Arc<Trace>>) -> NoticeSink {
    Arc::new(move |n: Notice| {
        if !matches!(n, Notice::Planned(_)) {
            eprintln!("{n}");
        }
        match &n {
            Notice::Planned(p) => {
                if let Some(t) = &trace {
                    t.write(json!({
                        "event": "cache", "id": p.job, "slot": p.slot, "queue_s": p.queue_s,
                        "cache_source": p.source.as_str(), "reused_tokens": p.reused,
                        "cut_tokens": p.cut, "prompt_tokens": p.prompt_tokens,
                        "checkpoint_file": p.checkpoint.as_ref().map(|f| f.display().to_string()),
                        "miss": p.miss.as_ref().map(|m| m.describe()),
                        "disk_choice": p.weighed.iter().map(|w| json!({
                            "file": w.path.display().to_string(), "whole": w.whole,
                            "tokens": w.tokens, "reusable_tokens": w.reusable,
                            "file_bytes": w.file_bytes, "load_s": w.load_s,
                            "prefill_s": w.prefill_s, "verdict": w.verdict.as_str(),
                        })).collect::<Vec<_>>(),
                    }));
                }
            }
            Notice::Finished(r) => {
                metrics.job(&JobStats {
                    prompt_tokens: r.prompt_tokens,
                    cached_tokens: r.reused,
                    generated_tokens: r.generated,
                    draft_tokens: r.drafted,
                    accepted_draft_tokens: r.accepted,
                    prefill_s: r.prefill_s,
                    decode_s: r.decode_s,
                    queue_s: r.queue_s,
                    source: r.source,
                });
                if let Some(t) = &trace {
                    let mut record = json!({
                        "event": "request", "id": r.job, "route": r.route, "slot": r.slot,
                        "prompt": t.prompt(&r.prompt), "prompt_tokens": r.prompt_tokens,
                        "cache_source": r.source.as_str(), "reused_tokens": r.reused,
                        "cut_tokens": r.cut, "checkpoint_file": r.checkpoint.as_ref().map(|f| f.display().to_string()),
                        "prefilled_tokens": r.prompt_tokens - r.reused,
                        "checkpointed_tokens": r.checkpointed, "queue_s": r.queue_s,
                        "prefill_s": r.prefill_s, "decode_s": r.decode_s,
                        "generated_tokens": r.generated, "generated_text": r.generated_text,
                        "draft_tokens": r.drafted, "accepted_draft_tokens": r.accepted,
                        "finish_reason": r.finish.as_str(), "cancelled": r.cancelled,
                        "grammar": r.grammar,
                        "grammar_dropped": r.grammar_dropped, "mask_s": r.mask_s,
                        "grammar_wound_down": r.grammar_wound_down, "error": r.error,
                    });
                    if let (Some(o), Some(meta)) = (record.as_object_mut(), r.meta.as_object()) {
                        o.extend(meta.clone());
                    }
                    t.write(record);
                }
            }
            Notice::Refused {
                job,
                route,
                prompt,
                error,
            } => {
                if let Some(t) = &trace {
                    t.write(json!({
                        "event": "request", "id": job, "route": route,
                        "prompt": t.prompt(prompt), "error": error,
                    }));
                }
            }
            _ => {}
        }
    })
}
