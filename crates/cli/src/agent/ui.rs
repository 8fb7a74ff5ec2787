//! How `ds4 agent` reads and writes the terminal: a line editor with history
//! (rustyline) on a terminal, plain lines otherwise; ANSI dim for thinking
//! and chrome unless `--plain`; the transcript on stdout, or on stderr under
//! `-p` (whose stdout is the final answer alone).

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use anyhow::Result;
use rustyline::error::ReadlineError;

/// A line the user typed, or why there is none.
pub enum Line {
    Text(String),
    /// Ctrl-C at the prompt.
    Interrupted,
    /// End of input (Ctrl-D, a closed pipe).
    Eof,
}

enum Input {
    Editor(Box<rustyline::DefaultEditor>, Option<PathBuf>),
    /// Lines read on a thread of their own, so that a Ctrl-C (a SIGINT
    /// counted in `interrupts`) ends the wait for one.
    Plain {
        lines: mpsc::Receiver<String>,
        interrupts: Arc<AtomicUsize>,
    },
}

pub struct Ui {
    input: Input,
    /// Where the transcript goes.
    out: Box<dyn Write>,
    ansi: bool,
}

const DIM: &str = "\x1b[2m";
const BOLD: &str = "\x1b[1m";
const CYAN: &str = "\x1b[36m";
const RED: &str = "\x1b[31m";
const RESET: &str = "\x1b[0m";

/// A style for a piece of chrome.
#[derive(Clone, Copy)]
pub enum Style {
    Plain,
    /// Thinking, status lines, notices.
    Dim,
    /// A tool call.
    Tool,
    Error,
    Prompt,
}

impl Ui {
    /// `plain`: no ANSI, no line editor; `transcript_on_stderr` for `-p`;
    /// `history`: the line editor's history file; `interrupts` counts
    /// Ctrl-C outside the line editor.
    pub fn new(
        plain: bool,
        transcript_on_stderr: bool,
        history: Option<PathBuf>,
        interrupts: Arc<AtomicUsize>,
    ) -> Self {
        use std::io::IsTerminal;
        let tty = std::io::stdin().is_terminal() && std::io::stdout().is_terminal();
        let input = match (plain || !tty, rustyline::DefaultEditor::new()) {
            (false, Ok(mut ed)) => {
                if let Some(h) = &history {
                    let _ = ed.load_history(h);
                }
                Input::Editor(Box::new(ed), history)
            }
            _ => {
                let (tx, lines) = mpsc::channel();
                std::thread::spawn(move || {
                    for line in std::io::stdin().lock().lines() {
                        let Ok(line) = line else { break };
                        if tx.send(line).is_err() {
                            break;
                        }
                    }
                });
                Input::Plain { lines, interrupts }
            }
        };
        let out: Box<dyn Write> = match transcript_on_stderr {
            true => Box::new(std::io::stderr()),
            false => Box::new(std::io::stdout()),
        };
        Ui {
            input,
            out,
            ansi: !plain,
        }
    }

    /// Reads a line after `prompt`.
    pub fn read_line(&mut self, prompt: &str) -> Result<Line> {
        match &mut self.input {
            Input::Editor(ed, history) => match ed.readline(prompt) {
                Ok(l) => {
                    if !l.trim().is_empty() {
                        let _ = ed.add_history_entry(l.as_str());
                        if let Some(h) = history {
                            let _ = ed.save_history(h);
                            restrict(h);
                        }
                    }
                    Ok(Line::Text(l))
                }
                Err(ReadlineError::Interrupted) => Ok(Line::Interrupted),
                Err(ReadlineError::Eof) => Ok(Line::Eof),
                Err(e) => Err(e.into()),
            },
            Input::Plain { lines, interrupts } => {
                self.out.write_all(prompt.as_bytes())?;
                self.out.flush()?;
                let seen = interrupts.load(Ordering::Acquire);
                loop {
                    if interrupts.load(Ordering::Acquire) != seen {
                        return Ok(Line::Interrupted);
                    }
                    match lines.recv_timeout(Duration::from_millis(20)) {
                        Ok(l) => return Ok(Line::Text(l.trim_end_matches('\r').to_string())),
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(Line::Eof),
                    }
                }
            }
        }
    }

    /// Asks a y/N question; only `y`/`yes` is yes.
    pub fn confirm(&mut self, question: &str) -> Result<bool> {
        let prompt = self.styled(Style::Prompt, &format!("{question} [y/N] "));
        Ok(match self.read_line(&prompt)? {
            Line::Text(t) => matches!(t.trim().to_ascii_lowercase().as_str(), "y" | "yes"),
            Line::Interrupted | Line::Eof => false,
        })
    }

    pub fn styled(&self, style: Style, text: &str) -> String {
        let code = match style {
            Style::Plain => return text.to_string(),
            Style::Dim => DIM,
            Style::Tool => CYAN,
            Style::Error => RED,
            Style::Prompt => BOLD,
        };
        match self.ansi {
            true => format!("{code}{text}{RESET}"),
            false => text.to_string(),
        }
    }

    /// Writes `text` in `style`, as it comes (no newline added).
    pub fn write(&mut self, style: Style, text: &str) -> Result<()> {
        let s = self.styled(style, text);
        self.out.write_all(s.as_bytes())?;
        self.out.flush()?;
        Ok(())
    }

    /// Writes a line in `style`.
    pub fn line(&mut self, style: Style, text: &str) -> Result<()> {
        self.write(style, text)?;
        self.write(Style::Plain, "\n")
    }
}

/// The history file is the user's typed text: 0600.
fn restrict(path: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600));
}
