//! `--trace FILE`: one JSON object per line for every cache decision and every
//! finished request, written by the engine worker and flushed line by line so a
//! crash loses nothing already decided. With `--trace-redact` prompts appear only
//! as their SHA-1 and length.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Mutex;

use serde_json::{json, Value};

pub struct Trace {
    out: Mutex<BufWriter<File>>,
    redact: bool,
}

impl Trace {
    /// Creates (truncates) `path`, mode 0600 on Unix: it holds prompts verbatim.
    /// An existing file gets that mode too (the open's mode applies only to a
    /// file it creates), set on the open descriptor before anything is written.
    pub fn create(path: &Path, redact: bool) -> std::io::Result<Trace> {
        let mut opts = std::fs::OpenOptions::new();
        opts.write(true).create(true).truncate(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
        let file = opts.open(path)?;
        #[cfg(unix)]
        file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        Ok(Trace {
            out: Mutex::new(BufWriter::new(file)),
            redact,
        })
    }

    /// The prompt as the trace shows it: verbatim, or SHA-1 and length.
    pub fn prompt(&self, prompt: &str) -> Value {
        let sha1: String = ds4_kvstore::text_hash(prompt.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        if self.redact {
            json!({ "prompt_sha1": sha1, "prompt_bytes": prompt.len() })
        } else {
            json!({ "prompt_sha1": sha1, "prompt_bytes": prompt.len(), "prompt": prompt })
        }
    }

    /// Writes one record, stamped with the Unix time. A failing trace file is
    /// reported once per failure and never stops serving.
    pub fn write(&self, mut record: Value) {
        if let Some(o) = record.as_object_mut() {
            let ts = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            o.insert("ts".into(), json!(ts));
        }
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        let line = format!("{record}\n");
        if let Err(e) = out.write_all(line.as_bytes()).and_then(|()| out.flush()) {
            eprintln!("trace write failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_json_and_redaction_hides_the_prompt() {
        let dir = std::env::temp_dir().join(format!("ds4-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.jsonl");
        let t = Trace::create(&p, true).unwrap();
        t.write(json!({ "event": "request", "p": t.prompt("secret prompt") }));
        t.write(json!({ "event": "cache" }));
        let text = std::fs::read_to_string(&p).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert!(!text.contains("secret"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            // An existing world-readable file is tightened, not kept as it was.
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
            drop(Trace::create(&p, true).unwrap());
            let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
        }
        assert_eq!(lines[0]["p"]["prompt_bytes"], 13);
        assert_eq!(lines[0]["p"]["prompt_sha1"].as_str().unwrap().len(), 40);
        assert!(lines[1]["ts"].as_f64().unwrap() > 1e9);
        #[cfg(unix)]
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&p).unwrap().permissions())
                & 0o777,
            0o600
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
