//! The harness the `ds4 serve` integration tests share: start the real binary on
//! a free port, talk HTTP/1.1 to it over a plain TcpStream, stop it with SIGTERM.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

pub struct Server {
    pub child: Child,
    pub port: u16,
    pub log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Server {
    pub fn start(args: &[&str]) -> Server {
        Self::start_with_env(args, &[])
    }

    /// `start` with extra environment variables for the server process.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        // One thread unless the test asks for more.
        let threads: &[&str] = if args.contains(&"--threads") {
            &[]
        } else {
            &["--threads", "1"]
        };
        let mut child = Command::new(env!("CARGO_BIN_EXE_ds4"))
            .args(["serve", "--port", "0"])
            .args(threads)
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning ds4 serve");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut log = String::new();
        let port = loop {
            let line = lines.next().expect("ds4 serve exited early").unwrap();
            log.push_str(&line);
            log.push('\n');
            if let Some(addr) = line.strip_prefix("ds4 serve: listening on http://") {
                break addr.rsplit(':').next().unwrap().parse().unwrap();
            }
        };
        let log = std::sync::Arc::new(std::sync::Mutex::new(log));
        let sink = std::sync::Arc::clone(&log);
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        Server { child, port, log }
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Panics if the server process has exited (a crash).
    pub fn assert_alive(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("ds4 serve died: {status}\n{}", self.log());
        }
    }

    /// Waits (at most 30 s) until the log holds `needle` `n` times (a
    /// background save's line, say).
    pub fn wait_for_log(&self, needle: &str, n: usize) {
        let t = std::time::Instant::now();
        while self.log().matches(needle).count() < n {
            assert!(
                t.elapsed().as_secs() < 30,
                "{n} x {needle:?} not seen:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `kill -9`: no shutdown, no save.
    pub fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// SIGTERM, then wait for a clean exit.
    pub fn stop(mut self) -> String {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "ds4 serve exit: {status}\n{}", self.log());
        std::thread::sleep(Duration::from_millis(100));
        self.log()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct Reply {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<String> {
        self.headers.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    }
}

pub fn request(port: u16, method: &str, path: &str, body: &[u8], extra: &[(&str, &str)]) -> Reply {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (headers, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = headers.split(' ').nth(1).unwrap().parse().unwrap();
    let body = if headers
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    Reply {
        status,
        headers: headers.to_string(),
        body,
    }
}

pub fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

pub fn post(port: u16, path: &str, body: &Value) -> Reply {
    request(port, "POST", path, body.to_string().as_bytes(), &[])
}

/// The data payloads of an SSE body.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

pub fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ds4-serve-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Serve flags for a checkpoint store in `kv` that saves from 16 tokens on.
pub fn kv_flags(kv: &std::path::Path) -> [&str; 4] {
    [
        "--kv-disk-dir",
        kv.to_str().unwrap(),
        "--kv-cache-min-tokens",
        "16",
    ]
}

/// The `(event, data)` pairs of an SSE body (comments skipped).
pub fn sse_events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter_map(|block| {
            let mut name = None;
            let mut data = None;
            for l in block.lines() {
                if let Some(n) = l.strip_prefix("event: ") {
                    name = Some(n.to_string());
                } else if let Some(d) = l.strip_prefix("data: ") {
                    data = Some(serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")));
                }
            }
            match (name, data) {
                (Some(n), Some(d)) => Some((n, d)),
                (None, None) => None,
                (n, d) => panic!("SSE block without both event and data: {n:?} {d:?}"),
            }
        })
        .collect()
}
