//! The agent's tools: `read` (a range of lines), `write`, `edit` (one exact,
//! unique string replaced), `list`, `search` (a regex over the tree, ignored
//! files skipped as git would) and `bash` (in the working directory, with a
//! timeout). Every path goes through [`Workspace::resolve`]; every result is
//! cut to [`Limits::result_bytes`]. Which actions change things (and so are
//! confirmed first) is [`Action::changes`]; asking is the caller's.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ds4_chat::ToolSpec;
use serde_json::{json, Map, Value};

use crate::confine::Workspace;

/// What the tools may produce and take.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Bytes of one tool result (the rest is cut, and the cut said).
    pub result_bytes: usize,
    /// Lines `read` returns when no range is given.
    pub read_lines: usize,
    /// Matching lines `search` reports.
    pub search_matches: usize,
    /// How long `bash` may run.
    pub bash_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            result_bytes: 16 * 1024,
            read_lines: 400,
            search_matches: 100,
            bash_timeout: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error("{path}: outside the working directory {root}")]
    Outside { path: String, root: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("unknown tool {0:?}")]
    Unknown(String),
    #[error("{tool}: {why}")]
    Arguments { tool: &'static str, why: String },
    #[error("{path}: the text to replace was not found")]
    NotFound { path: String },
    #[error(
        "{path}: the text to replace occurs {count} times; include more context so it occurs once"
    )]
    NotUnique { path: String, count: usize },
    #[error("{path}: not UTF-8 text")]
    NotText { path: String },
    #[error("search: {0}")]
    Pattern(#[from] regex::Error),
    #[error("bash: {0}")]
    Spawn(std::io::Error),
}

impl ToolError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> ToolError {
        ToolError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

/// One tool call, its arguments checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Lines `from..=to` (1-based; defaults: 1 and `read_lines` further).
    Read {
        path: String,
        from: Option<usize>,
        to: Option<usize>,
    },
    Write {
        path: String,
        content: String,
    },
    Edit {
        path: String,
        old: String,
        new: String,
    },
    List {
        path: String,
    },
    Search {
        pattern: String,
        path: String,
    },
    Bash {
        command: String,
    },
}

/// The tools as the model is told of them.
pub fn specs() -> Vec<ToolSpec> {
    let spec = |name: &str, description: &str, properties: Value, required: &[&str]| {
        let parameters =
            json!({ "type": "object", "properties": properties, "required": required });
        let raw = json!({ "type": "function", "function": {
            "name": name, "description": description, "parameters": parameters } });
        ToolSpec {
            name: name.into(),
            description: description.into(),
            parameters: parameters.to_string(),
            raw: raw.to_string(),
        }
    };
    let s = |d: &str| json!({ "type": "string", "description": d });
    let n = |d: &str| json!({ "type": "integer", "description": d });
    vec![
        spec(
            "read",
            "Read a text file, optionally lines from..to (1-based).",
            json!({ "path": s("file path"), "from": n("first line"), "to": n("last line") }),
            &["path"],
        ),
        spec(
            "write",
            "Create or overwrite a file with the given content.",
            json!({ "path": s("file path"), "content": s("the whole new content") }),
            &["path", "content"],
        ),
        spec(
            "edit",
            "Replace one exact occurrence of `old` with `new` in a file.",
            json!({ "path": s("file path"), "old": s("exact text to replace, unique in the file"), "new": s("replacement") }),
            &["path", "old", "new"],
        ),
        spec(
            "list",
            "List a directory.",
            json!({ "path": s("directory, . for the working directory") }),
            &["path"],
        ),
        spec(
            "search",
            "Search files under a directory for a regular expression.",
            json!({ "pattern": s("regular expression"), "path": s("directory or file, . for all") }),
            &["pattern"],
        ),
        spec(
            "bash",
            "Run a shell command in the working directory.",
            json!({ "command": s("the command") }),
            &["command"],
        ),
    ]
}

impl Action {
    /// The call `name(arguments)`, `arguments` a JSON object's text.
    pub fn parse(name: &str, arguments: &str) -> Result<Action, ToolError> {
        let tool: &'static str = match name {
            "read" => "read",
            "write" => "write",
            "edit" => "edit",
            "list" => "list",
            "search" => "search",
            "bash" => "bash",
            _ => return Err(ToolError::Unknown(name.to_string())),
        };
        let bad = |why: String| ToolError::Arguments { tool, why };
        let args: Map<String, Value> = match serde_json::from_str(arguments) {
            Ok(Value::Object(o)) => o,
            Ok(_) => return Err(bad("the arguments must be a JSON object".into())),
            Err(e) => return Err(bad(format!("the arguments are not JSON: {e}"))),
        };
        let text = |key: &str| -> Result<String, ToolError> {
            match args.get(key) {
                Some(Value::String(s)) => Ok(s.clone()),
                Some(_) => Err(bad(format!("`{key}` must be a string"))),
                None => Err(bad(format!("`{key}` is required"))),
            }
        };
        let line = |key: &str| -> Result<Option<usize>, ToolError> {
            match args.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_u64()
                    .filter(|&n| n >= 1)
                    .map(|n| Some(n as usize))
                    .ok_or_else(|| bad(format!("`{key}` must be a line number (1 or more)"))),
            }
        };
        let dir = |key: &str| -> Result<String, ToolError> {
            match args.get(key) {
                None | Some(Value::Null) => Ok(".".into()),
                Some(_) => text(key),
            }
        };
        Ok(match tool {
            "read" => Action::Read {
                path: text("path")?,
                from: line("from")?,
                to: line("to")?,
            },
            "write" => Action::Write {
                path: text("path")?,
                content: text("content")?,
            },
            "edit" => Action::Edit {
                path: text("path")?,
                old: text("old")?,
                new: text("new")?,
            },
            "list" => Action::List { path: dir("path")? },
            "search" => Action::Search {
                pattern: text("pattern")?,
                path: dir("path")?,
            },
            _ => Action::Bash {
                command: text("command")?,
            },
        })
    }

    /// Whether it changes files or runs a command (asked for unless `--yes`).
    pub fn changes(&self) -> bool {
        matches!(
            self,
            Action::Write { .. } | Action::Edit { .. } | Action::Bash { .. }
        )
    }

    /// One line saying what it does, for a confirmation.
    pub fn describe(&self) -> String {
        match self {
            Action::Read { path, from, to } => match (from, to) {
                (None, None) => format!("read {path}"),
                _ => format!(
                    "read {path} lines {}..{}",
                    from.unwrap_or(1),
                    to.map_or_else(String::new, |t| t.to_string())
                ),
            },
            Action::Write { path, content } => {
                format!("write {path} ({} bytes)", content.len())
            }
            Action::Edit { path, old, new } => format!(
                "edit {path} (replace {} bytes with {})",
                old.len(),
                new.len()
            ),
            Action::List { path } => format!("list {path}"),
            Action::Search { pattern, path } => format!("search {pattern:?} in {path}"),
            Action::Bash { command } => format!("bash: {command}"),
        }
    }

    /// Runs it in `ws`; the result is at most `limits.result_bytes`.
    pub fn run(&self, ws: &Workspace, limits: &Limits) -> Result<String, ToolError> {
        let out = match self {
            Action::Read { path, from, to } => read(ws, path, *from, *to, limits)?,
            Action::Write { path, content } => {
                let p = ws.resolve(path)?;
                if let Some(parent) = p.parent() {
                    std::fs::create_dir_all(parent).map_err(|e| ToolError::io(parent, e))?;
                }
                std::fs::write(&p, content).map_err(|e| ToolError::io(&p, e))?;
                format!("wrote {} bytes to {}", content.len(), ws.show(&p))
            }
            Action::Edit { path, old, new } => edit(ws, path, old, new)?,
            Action::List { path } => list(ws, path)?,
            Action::Search { pattern, path } => search(ws, pattern, path, limits)?,
            Action::Bash { command } => bash(ws.root(), command, limits)?,
        };
        Ok(bound(out, limits.result_bytes))
    }
}

/// `text` cut to `max` bytes (at a character boundary), saying what was cut.
fn bound(mut text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    let mut cut = max;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let dropped = text.len() - cut;
    text.truncate(cut);
    text.push_str(&format!("\n[... {dropped} more bytes not shown]"));
    text
}

fn read_text(p: &Path, ws: &Workspace) -> Result<String, ToolError> {
    let bytes = std::fs::read(p).map_err(|e| ToolError::io(p, e))?;
    String::from_utf8(bytes).map_err(|_| ToolError::NotText { path: ws.show(p) })
}

fn read(
    ws: &Workspace,
    path: &str,
    from: Option<usize>,
    to: Option<usize>,
    limits: &Limits,
) -> Result<String, ToolError> {
    let p = ws.resolve(path)?;
    let text = read_text(&p, ws)?;
    let total = text.lines().count();
    let from = from.unwrap_or(1);
    let to = to
        .unwrap_or(from + limits.read_lines - 1)
        .min(total)
        .min(from + limits.read_lines - 1);
    let mut out = format!("{} lines {from}-{to} of {total}\n", ws.show(&p));
    for line in text
        .lines()
        .skip(from - 1)
        .take((to + 1).saturating_sub(from))
    {
        out.push_str(line);
        out.push('\n');
    }
    Ok(out)
}

fn edit(ws: &Workspace, path: &str, old: &str, new: &str) -> Result<String, ToolError> {
    let p = ws.resolve(path)?;
    let text = read_text(&p, ws)?;
    let shown = ws.show(&p);
    let count = if old.is_empty() {
        0
    } else {
        text.matches(old).count()
    };
    match count {
        0 => return Err(ToolError::NotFound { path: shown }),
        1 => {}
        _ => return Err(ToolError::NotUnique { path: shown, count }),
    }
    std::fs::write(&p, text.replacen(old, new, 1)).map_err(|e| ToolError::io(&p, e))?;
    Ok(format!("edited {shown}"))
}

/// Entries listed by `list` at most.
const LIST_MAX: usize = 500;

fn list(ws: &Workspace, path: &str) -> Result<String, ToolError> {
    let p = ws.resolve(path)?;
    let mut names: Vec<String> = std::fs::read_dir(&p)
        .map_err(|e| ToolError::io(&p, e))?
        .filter_map(Result::ok)
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            match e.file_type().is_ok_and(|t| t.is_dir()) {
                true => format!("{name}/"),
                false => name,
            }
        })
        .collect();
    names.sort();
    let n = names.len();
    names.truncate(LIST_MAX);
    let mut out = names.join("\n");
    if n > LIST_MAX {
        out.push_str(&format!("\n[... {} more entries]", n - LIST_MAX));
    }
    if out.is_empty() {
        out = format!("{} is empty", ws.show(&p));
    }
    Ok(out)
}

/// Characters of a matching line that `search` shows.
const LINE_MAX: usize = 200;

fn search(ws: &Workspace, pattern: &str, path: &str, limits: &Limits) -> Result<String, ToolError> {
    let re = regex::Regex::new(pattern)?;
    let start = ws.resolve(path)?;
    let mut out = String::new();
    let mut found = 0;
    // .gitignore honoured in any directory, not only inside a git repository.
    let walk = ignore::WalkBuilder::new(&start).require_git(false).build();
    'files: for entry in walk.filter_map(Result::ok) {
        if !entry.file_type().is_some_and(|t| t.is_file()) {
            continue;
        }
        // The walk does not follow links; a file is read only when inside.
        let Ok(file) = ws.resolve(&entry.path().to_string_lossy()) else {
            continue;
        };
        let Ok(bytes) = std::fs::read(&file) else {
            continue;
        };
        if bytes[..bytes.len().min(8192)].contains(&0) {
            continue; // binary
        }
        let text = String::from_utf8_lossy(&bytes);
        for (i, line) in text.lines().enumerate() {
            if re.is_match(line) {
                if found == limits.search_matches {
                    out.push_str(&format!("[stopped at {} matches]\n", limits.search_matches));
                    break 'files;
                }
                found += 1;
                let shown: String = line.chars().take(LINE_MAX).collect();
                out.push_str(&format!("{}:{}: {shown}\n", ws.show(&file), i + 1));
            }
        }
    }
    if found == 0 {
        out = format!("no match for {pattern:?}");
    }
    Ok(out)
}

/// Runs `command` with `bash -c` in `dir`, in its own process group (killed
/// whole at the timeout), stdin closed; stdout and stderr each kept up to the
/// result size.
fn bash(dir: &Path, command: &str, limits: &Limits) -> Result<String, ToolError> {
    use std::os::unix::process::CommandExt;
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(command)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(ToolError::Spawn)?;
    let cap = limits.result_bytes;
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let (mut kept, mut total) = (Vec::new(), 0);
            if let Some(mut p) = pipe {
                let mut buf = [0u8; 8192];
                while let Ok(n) = p.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    total += n;
                    let room = cap.saturating_sub(kept.len());
                    kept.extend_from_slice(&buf[..n.min(room)]);
                }
            }
            let mut text = String::from_utf8_lossy(&kept).into_owned();
            if total > kept.len() {
                text.push_str(&format!(
                    "\n[... {} more bytes not shown]\n",
                    total - kept.len()
                ));
            }
            text
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let deadline = Instant::now() + limits.bash_timeout;
    let status = loop {
        match child.try_wait().map_err(ToolError::Spawn)? {
            Some(s) => break Some(s),
            None if Instant::now() >= deadline => {
                // The whole group: what the command started holds the pipes too.
                let _ = Command::new("kill")
                    .args(["-s", "KILL", "--", &format!("-{}", child.id())])
                    .status();
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    };
    let (stdout, stderr) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    let mut result = stdout;
    if !stderr.is_empty() {
        result.push_str(&format!("[stderr]\n{stderr}"));
    }
    match status {
        Some(s) if s.success() => {}
        Some(s) => result.push_str(&format!("[exit status {}]", s.code().unwrap_or(-1))),
        None => result.push_str(&format!(
            "[killed after {} s]",
            limits.bash_timeout.as_secs_f64()
        )),
    }
    if result.is_empty() {
        result = "(no output)".into();
    }
    Ok(result)
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// A fresh directory under the system's temp dir, and a workspace on it.
    pub fn scratch(name: &str) -> (std::path::PathBuf, Workspace) {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("ds4-agent-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ws = Workspace::new(&dir).unwrap();
        (dir, ws)
    }
}

#[cfg(test)]
mod tests {
    use super::testing::scratch;
    use super::*;

    fn run(ws: &Workspace, name: &str, args: Value) -> Result<String, ToolError> {
        Action::parse(name, &args.to_string())?.run(ws, &Limits::default())
    }

    #[test]
    fn read_takes_line_ranges_and_is_bounded() {
        let (dir, ws) = scratch("read");
        let text: String = (1..=1000).map(|i| format!("line {i}\n")).collect();
        std::fs::write(dir.join("f.txt"), &text).unwrap();
        let r = run(&ws, "read", json!({"path": "f.txt", "from": 3, "to": 4})).unwrap();
        assert_eq!(r, "f.txt lines 3-4 of 1000\nline 3\nline 4\n");
        let r = run(&ws, "read", json!({"path": "f.txt"})).unwrap();
        assert!(r.starts_with("f.txt lines 1-400 of 1000\n") && r.ends_with("line 400\n"));
        let r = run(
            &ws,
            "read",
            json!({"path": "f.txt", "from": 999, "to": 5000}),
        )
        .unwrap();
        assert_eq!(r, "f.txt lines 999-1000 of 1000\nline 999\nline 1000\n");
        let small = Limits {
            result_bytes: 20,
            ..Limits::default()
        };
        let r = Action::parse("read", r#"{"path":"f.txt"}"#)
            .unwrap()
            .run(&ws, &small)
            .unwrap();
        assert!(r.starts_with("f.txt lines 1-400 of") && r.contains("more bytes not shown"));
        assert!(matches!(
            run(&ws, "read", json!({"path": "f.txt", "from": 0})),
            Err(ToolError::Arguments { .. })
        ));
        assert!(matches!(
            run(&ws, "read", json!({"path": "missing"})),
            Err(ToolError::Io { .. })
        ));
        std::fs::write(dir.join("bin"), [0xff, 0xfe, 0]).unwrap();
        assert!(matches!(
            run(&ws, "read", json!({"path": "bin"})),
            Err(ToolError::NotText { .. })
        ));
    }

    #[test]
    fn write_creates_parents_and_edit_replaces_one_unique_string() {
        let (dir, ws) = scratch("write");
        run(
            &ws,
            "write",
            json!({"path": "a/b/c.txt", "content": "one two two"}),
        )
        .unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("a/b/c.txt")).unwrap(),
            "one two two"
        );
        let e = run(
            &ws,
            "edit",
            json!({"path": "a/b/c.txt", "old": "two", "new": "2"}),
        );
        assert!(
            matches!(e, Err(ToolError::NotUnique { count: 2, .. })),
            "{e:?}"
        );
        let e = run(
            &ws,
            "edit",
            json!({"path": "a/b/c.txt", "old": "three", "new": "3"}),
        );
        assert!(matches!(e, Err(ToolError::NotFound { .. })), "{e:?}");
        let e = run(
            &ws,
            "edit",
            json!({"path": "a/b/c.txt", "old": "", "new": "3"}),
        );
        assert!(matches!(e, Err(ToolError::NotFound { .. })), "{e:?}");
        run(
            &ws,
            "edit",
            json!({"path": "a/b/c.txt", "old": "one", "new": "1"}),
        )
        .unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("a/b/c.txt")).unwrap(),
            "1 two two"
        );
        // Nothing outside, whatever the way.
        let (outside, _) = scratch("write-outside");
        std::os::unix::fs::symlink(&outside, dir.join("out")).unwrap();
        for path in ["../x", "out/x", outside.join("x").to_str().unwrap()] {
            let e = run(&ws, "write", json!({"path": path, "content": "x"}));
            assert!(matches!(e, Err(ToolError::Outside { .. })), "{path}: {e:?}");
        }
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
    }

    #[test]
    fn list_marks_directories() {
        let (dir, ws) = scratch("list");
        std::fs::create_dir(dir.join("sub")).unwrap();
        std::fs::write(dir.join("z.txt"), "").unwrap();
        assert_eq!(
            run(&ws, "list", json!({"path": "."})).unwrap(),
            "sub/\nz.txt"
        );
        assert_eq!(run(&ws, "list", json!({})).unwrap(), "sub/\nz.txt");
        assert_eq!(
            run(&ws, "list", json!({"path": "sub"})).unwrap(),
            "sub is empty"
        );
        assert!(matches!(
            run(&ws, "list", json!({"path": "/"})),
            Err(ToolError::Outside { .. })
        ));
    }

    #[test]
    fn search_honours_gitignore_and_is_bounded() {
        let (dir, ws) = scratch("search");
        std::fs::create_dir_all(dir.join("src")).unwrap();
        std::fs::create_dir_all(dir.join("target")).unwrap();
        std::fs::write(dir.join(".gitignore"), "target/\n").unwrap();
        std::fs::write(dir.join("src/lib.rs"), "fn main() {}\nfn helper() {}\n").unwrap();
        std::fs::write(dir.join("target/gen.rs"), "fn generated() {}\n").unwrap();
        let r = run(&ws, "search", json!({"pattern": "^fn \\w+"})).unwrap();
        assert_eq!(
            r,
            "src/lib.rs:1: fn main() {}\nsrc/lib.rs:2: fn helper() {}\n"
        );
        let many: String = (0..500).map(|i| format!("hit {i}\n")).collect();
        std::fs::write(dir.join("src/many.txt"), many).unwrap();
        let r = run(&ws, "search", json!({"pattern": "hit", "path": "src"})).unwrap();
        assert_eq!(r.lines().filter(|l| l.contains(": hit")).count(), 100);
        assert!(r.contains("[stopped at 100 matches]"));
        assert!(matches!(
            run(&ws, "search", json!({"pattern": "("})),
            Err(ToolError::Pattern(_))
        ));
        assert_eq!(
            run(&ws, "search", json!({"pattern": "nothing-here-at-all-xyz"})).unwrap(),
            "no match for \"nothing-here-at-all-xyz\""
        );
        assert!(matches!(
            run(&ws, "search", json!({"pattern": "x", "path": ".."})),
            Err(ToolError::Outside { .. })
        ));
    }

    #[test]
    fn bash_runs_in_the_root_with_a_timeout_and_an_output_cap() {
        let (dir, ws) = scratch("bash");
        std::fs::write(dir.join("here.txt"), "").unwrap();
        assert_eq!(
            run(&ws, "bash", json!({"command": "ls"})).unwrap(),
            "here.txt\n"
        );
        let r = run(&ws, "bash", json!({"command": "echo oops >&2; exit 3"})).unwrap();
        assert_eq!(r, "[stderr]\noops\n[exit status 3]");
        let quick = Limits {
            bash_timeout: Duration::from_millis(300),
            result_bytes: 1000,
            ..Limits::default()
        };
        let t = Instant::now();
        let r = Action::parse("bash", r#"{"command":"sleep 30 & sleep 30"}"#)
            .unwrap()
            .run(&ws, &quick)
            .unwrap();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(r.contains("[killed after 0.3 s]"), "{r}");
        let r = Action::parse("bash", r#"{"command":"yes | head -c 100000"}"#)
            .unwrap()
            .run(&ws, &quick)
            .unwrap();
        assert!(
            r.len() < 1100 && r.contains("more bytes not shown"),
            "{}",
            r.len()
        );
    }

    #[test]
    fn calls_are_checked_and_changes_are_marked() {
        assert!(matches!(
            Action::parse("rm", "{}"),
            Err(ToolError::Unknown(_))
        ));
        assert!(matches!(
            Action::parse("bash", "[1]"),
            Err(ToolError::Arguments { .. })
        ));
        assert!(matches!(
            Action::parse("write", r#"{"path":"x"}"#),
            Err(ToolError::Arguments { .. })
        ));
        let changes: Vec<bool> = specs()
            .iter()
            .map(|s| {
                let args = match s.name.as_str() {
                    "bash" => r#"{"command":"ls"}"#,
                    "search" => r#"{"pattern":"x"}"#,
                    _ => r#"{"path":"x","content":"","old":"a","new":"b"}"#,
                };
                Action::parse(&s.name, args).unwrap().changes()
            })
            .collect();
        assert_eq!(changes, [false, true, true, false, false, true]);
    }
}
