//! `ds4 agent`: a terminal coding agent on the in-process runtime. Each user
//! message runs up to `--max-steps` model turns: the conversation rendered
//! with the tool list, the answer streamed, tool calls (the family's own
//! syntax, parsed as they stream) run in `--cwd` and their results appended,
//! until a turn makes no call. Sessions are checkpoints: the system prompt
//! and tool list is one (`agent-system`, restored at start-up instead of
//! prefilled), each conversation's state is saved at every turn end
//! (`agent-session`) in `$DS4_HOME/agent/kv`, its messages and title in
//! `$DS4_HOME/agent/sessions`; `/switch` loads a conversation back with
//! nothing prefilled.

mod ui;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use anyhow::{bail, Context, Result};
use clap::Args;
use ds4_agent::tools::{specs, Limits};
use ds4_agent::{Action, SessionIndex, SessionRecord, Workspace};
use ds4_chat::turn::{Piece, Shaper};
use ds4_chat::{
    ChatMl, Message, Prompt, RenderOptions, Role, Template, ThinkMode, ToolChoice, ToolSpec,
};
use ds4_engine::{Model, SamplerConfig};
use ds4_grammar::Vocab;
use ds4_kvstore::{SavePolicy, SaveReason, Store, StoreConfig};
use ds4_runtime::{
    CallPlan, Event, Job, Notice, NoticeSink, Persist, Runtime, RuntimeConfig, TokenLimit, Usage,
};
use ds4_server::prepare::encode_prompt;
use tokio::sync::mpsc;

use crate::generate::{load, Loaded, SamplingArgs};
use crate::turns::{stream, Outcome};
use crate::ModelArgs;
use ui::{Line, Style, Ui};

#[derive(Args, Clone, Debug)]
pub struct AgentArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// The directory the tools work in; no path outside it is read or written
    /// (default: the current directory).
    #[arg(long, value_name = "DIR")]
    pub cwd: Option<PathBuf>,
    /// Run writes, edits and bash commands without asking first.
    #[arg(long)]
    pub yes: bool,
    /// No colours, progress bar or line editor (for pipes and logs).
    #[arg(long)]
    pub plain: bool,
    /// Run one task without asking for input and print the final answer on
    /// stdout (the transcript goes to stderr).
    #[arg(short = 'p', long = "prompt", value_name = "TASK")]
    pub task: Option<String>,
    /// Tool calls on the first turn of each message: auto (the model
    /// decides), required (a call is forced, held to the call grammar, as the
    /// server's tool_choice required), a tool's name (a call of that tool),
    /// none (no tools offered). Later turns of a message are auto.
    #[arg(long, value_name = "auto|required|none|TOOL", default_value = "auto", value_parser = tool_choice)]
    pub tool_choice: String,
    /// Model turns per message at most (each tool round is one).
    #[arg(long, default_value_t = 8)]
    pub max_steps: usize,
    /// Answer without thinking, in families that think.
    #[arg(long)]
    pub no_think: bool,
    /// Collapse the model's thinking to one line per turn (`/think` shows the
    /// last one in full, `/thinking` toggles); by default it streams dimmed.
    #[arg(long)]
    pub collapse_thinking: bool,
    /// Where sessions live: checkpoints in DIR/kv, the index in DIR/sessions
    /// (default: $DS4_HOME/agent).
    #[arg(long, value_name = "DIR")]
    pub agent_dir: Option<PathBuf>,
    /// Show every notice of the runtime and its store (plans, saves, loads,
    /// removals), not only failures.
    #[arg(short, long)]
    pub verbose: bool,
    /// Byte budget of the agent's checkpoints in MiB (its own store, apart
    /// from the server's).
    #[arg(long, default_value_t = 2048)]
    pub agent_space_mb: u64,
}

const SYSTEM_PROMPT: &str = "You are ds4 agent, a coding assistant in a terminal. \
You work on the files of the user's project through the tools; paths are relative \
to the project directory. Use a tool when you need to look at or change something, \
then answer briefly.";

const HELP: &str = "/new               start a new session
/list              sessions: id, title, tokens, age, checkpoint size
/switch ID         continue session ID (its checkpoint restored, nothing prefilled)
/save              save the session's index now (its state is saved at every turn end)
/del ID            delete a session and its checkpoints
/strip ID          drop a session's checkpoints, keep its text: a switch prefills again
/history           the current session's messages
/think             the last turn's thinking in full
/thinking          collapse thinking to one line per turn, or stream it again
/compact           summarise this session with the model into a new one
/help              this list
/exit              save and quit (Ctrl-D too; Ctrl-C stops a generation, twice quits)";

/// Messages of a /compact summary request.
const COMPACT_REQUEST: &str = "Summarise our conversation so far in a few sentences: \
the task, what was found and changed, and what is left to do.";

pub fn run(a: &AgentArgs) -> Result<()> {
    let cwd = match &a.cwd {
        Some(d) => d.clone(),
        None => std::env::current_dir()?,
    };
    let ws = Workspace::new(&cwd).with_context(|| format!("--cwd {}", cwd.display()))?;
    let home = match &a.agent_dir {
        Some(d) => d.clone(),
        None => crate::models::ds4_home()?.join("agent"),
    };
    let mut agent = Agent::start(a, ws, &home)?;
    let result = match &a.task {
        Some(task) => agent.task(task),
        None => agent.interactive(),
    };
    agent.close()?;
    result
}

struct Agent<'a> {
    a: &'a AgentArgs,
    model: Arc<Model>,
    model_name: String,
    n_ctx: usize,
    template: Box<dyn Template>,
    /// Built on the first constrained turn (it walks the whole vocabulary).
    vocab: OnceLock<Result<Vocab, String>>,
    runtime: Option<Runtime>,
    tools: Vec<ToolSpec>,
    ws: Workspace,
    limits: Limits,
    index: SessionIndex,
    /// The agent's store, for removing and sizing checkpoints (the runtime
    /// has its own handle on the same directory).
    store: Store,
    /// The agent-system checkpoint's name, never removed with a session's.
    system_hash: String,
    session: SessionRecord,
    /// The conversation after the system message.
    history: Vec<Message>,
    ui: Ui,
    sampling: SamplerConfig,
    interrupts: Arc<AtomicUsize>,
    /// The Ctrl-C count when the current message was sent.
    baseline: usize,
    jobs: usize,
    think: ThinkMode,
    /// How thinking is shown, and the last turn's.
    thinking: Thinking,
}

impl<'a> Agent<'a> {
    fn start(a: &'a AgentArgs, ws: Workspace, home: &Path) -> Result<Self> {
        let Loaded {
            model,
            session,
            path,
        } = load(&a.model)?;
        // A model without a chat template (a base model such as Gemma 3 270M)
        // is prompted in ChatML, its markup plain text to it.
        let template = ds4_runtime::template_for(&model).unwrap_or_else(|| {
            Box::new(ChatMl {
                default_system: None,
            })
        });
        let think = match template.supports_thinking() && !a.no_think {
            true => ThinkMode::High,
            false => ThinkMode::None,
        };
        let kv_dir = home.join("kv");
        let config = StoreConfig {
            budget_bytes: a.agent_space_mb.saturating_mul(1 << 20),
            // Every agent checkpoint is a deliberate one (the system prompt, a
            // turn's end): no cold cache of chance prompts, a low minimum.
            policy: SavePolicy {
                min_tokens: 16,
                cold_max_tokens: 0,
                ..SavePolicy::default()
            },
            ..StoreConfig::default()
        };
        let runtime_store = Store::open(&kv_dir, config.clone())
            .with_context(|| format!("opening {}", kv_dir.display()))?;
        let store = Store::open(&kv_dir, config)?;
        let index = SessionIndex::open(&home.join("sessions"))?;
        let interrupts = Arc::new(AtomicUsize::new(0));
        let ui = Ui::new(
            a.plain,
            a.task.is_some(),
            (a.task.is_none()).then(|| home.join("history")),
            Arc::clone(&interrupts),
        );
        count_interrupts(&interrupts).context("watching for Ctrl-C")?;
        // The runtime's failures dimmed on stderr (everything with
        // --verbose); plans, saves and loads are what the status line sums up.
        let (dim, verbose) = (!a.plain, a.verbose);
        let notices: NoticeSink = Arc::new(move |n: Notice| {
            let failure = matches!(
                n,
                Notice::Refused { .. }
                    | Notice::SaveFailed { .. }
                    | Notice::LoadFailed { .. }
                    | Notice::Skipped { .. }
            );
            if !(failure || verbose) {
                return;
            }
            match dim {
                true => eprintln!("\x1b[2m{n}\x1b[0m"),
                false => eprintln!("{n}"),
            }
        });
        let persist = Persist::new(runtime_store, &session, None, Arc::clone(&notices));
        let n_ctx = session.n_ctx();
        let pool = Arc::clone(session.pool());
        let runtime = Runtime::start(
            vec![session],
            pool,
            Some(persist),
            RuntimeConfig::default(),
            notices,
        );
        let tools = match a.tool_choice.as_str() {
            "none" => vec![],
            _ => specs(),
        };
        let mut agent = Agent {
            a,
            model,
            model_name: path
                .file_stem()
                .map_or_else(String::new, |s| s.to_string_lossy().into_owned()),
            n_ctx,
            template,
            vocab: OnceLock::new(),
            runtime: Some(runtime),
            tools,
            ws,
            limits: Limits::default(),
            session: SessionRecord::new(index.fresh_id(), now()),
            index,
            store,
            system_hash: String::new(),
            history: vec![],
            ui,
            sampling: a.sampling.config(),
            interrupts,
            baseline: 0,
            jobs: 0,
            think,
            thinking: Thinking {
                collapsed: a.collapse_thinking,
                ..Thinking::default()
            },
        };
        agent.restore_system()?;
        Ok(agent)
    }

    fn system(&self) -> Message {
        Message::new(Role::System, SYSTEM_PROMPT)
    }

    /// The conversation (system message first) rendered; with an open
    /// assistant turn when `generate`.
    fn render(&self, history: &[Message], generate: bool) -> Prompt {
        let mut all = vec![self.system()];
        all.extend_from_slice(history);
        self.template.render(
            &all,
            &RenderOptions {
                tools: &self.tools,
                think: self.think,
                add_generation_prompt: generate,
            },
        )
    }

    /// The text of the state a conversation's last turn left in the slot: its
    /// rendering up to the last end of turn (the end-of-turn token is fed;
    /// what the template writes after it is the next turn's).
    fn state_text(&self, history: &[Message]) -> Prompt {
        let full = self.render(history, false);
        let eot = self.template.end_of_turn();
        let (mut at, mut end) = (0, None);
        for (part, markup) in full.parts() {
            if let Some(i) = part.rfind(eot).filter(|_| markup) {
                end = Some(at + i + eot.len());
            }
            at += part.len();
        }
        match end {
            Some(e) => full.prefix(e),
            None => full,
        }
    }

    /// Brings the system prompt and tool list into the slot: restored from
    /// its `agent-system` checkpoint, else prefilled and saved as one.
    fn restore_system(&mut self) -> Result<()> {
        let prompt = self.state_text(&[]);
        self.system_hash = hex(&ds4_kvstore::text_hash(prompt.as_str().as_bytes()));
        // Only worth it when later prompts start with it.
        let later = self.render(&[Message::new(Role::User, "x")], true);
        if !later.as_str().starts_with(prompt.as_str()) {
            return Ok(());
        }
        let rx = self.submit(&prompt, 0, None, Some(SaveReason::AgentSystem))?;
        match stream(rx, self.bar_from(), None, |_| Ok(()))? {
            Outcome::Done { usage, .. } => {
                let words = match usage.prompt_tokens - usage.cached_tokens {
                    0 => format!(
                        "system prompt and tools: {} tokens restored from disk",
                        usage.cached_tokens
                    ),
                    n => format!(
                        "system prompt and tools: {n} tokens prefilled (saved as agent-system)"
                    ),
                };
                self.ui.line(Style::Dim, &words)?;
                Ok(())
            }
            Outcome::Failed(e) => bail!("the system prompt: {e}"),
            Outcome::Interrupted => bail!("interrupted"),
        }
    }

    fn bar_from(&self) -> Option<usize> {
        (!self.a.plain).then_some(64)
    }

    /// Queues a job for `prompt`, generating at most `limit` tokens under
    /// `gate`, the slot's state saved at its end under `save`.
    fn submit(
        &mut self,
        prompt: &Prompt,
        limit: usize,
        gate: Option<ds4_runtime::Gate>,
        save: Option<SaveReason>,
    ) -> Result<mpsc::Receiver<Event>> {
        let (tx, rx) = mpsc::channel(256);
        self.jobs += 1;
        let job = Job {
            id: format!("agent-{}", self.jobs),
            route: "agent".into(),
            ids: encode_prompt(&self.model.tokenizer, prompt),
            prompt: prompt.as_str().to_string(),
            sampling: self.sampling.clone(),
            limit: TokenLimit::Default(limit),
            stop: vec![],
            affinity: vec![],
            breakpoints: vec![],
            gate,
            turn_save: save,
            logprobs: None,
            prompt_logprobs: None,
            meta: serde_json::Value::Null,
            events: tx,
        };
        // Each turn draws from its own stream of the seed.
        self.sampling.seed = self.sampling.seed.wrapping_add(1);
        let runtime = self.runtime.as_ref().context("the runtime has stopped")?;
        runtime
            .handle
            .submit(job)
            .map_err(|e| anyhow::anyhow!("the runtime refused the turn: {e}"))?;
        Ok(rx)
    }

    fn interactive(&mut self) -> Result<()> {
        self.ui.line(
            Style::Dim,
            &format!(
                "ds4 agent in {} · session {} · /help for commands",
                self.ws.root().display(),
                self.session.id
            ),
        )?;
        let mut armed = false;
        loop {
            let prompt = self.ui.styled(Style::Prompt, "> ");
            let line = match self.ui.read_line(&prompt)? {
                Line::Eof => break,
                Line::Interrupted if armed => break,
                Line::Interrupted => {
                    armed = true;
                    self.ui
                        .line(Style::Dim, "(Ctrl-C again or /exit to quit)")?;
                    continue;
                }
                Line::Text(t) => t,
            };
            armed = false;
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            if line.starts_with('/') {
                match self.command(line) {
                    Ok(true) => continue,
                    Ok(false) => break,
                    Err(e) => {
                        self.ui.line(Style::Error, &format!("error: {e:#}"))?;
                        continue;
                    }
                }
            }
            match self.message(line)? {
                Reply::Interrupted => {
                    if self.interrupts.load(Ordering::Acquire) >= self.baseline + 2 {
                        break;
                    }
                    armed = true;
                    self.ui
                        .line(Style::Dim, "(stopped; Ctrl-C again to quit)")?;
                }
                Reply::Answer(_) | Reply::Failed => {}
            }
        }
        Ok(())
    }

    /// `-p TASK`: the final answer on stdout.
    fn task(&mut self, task: &str) -> Result<()> {
        match self.message(task)? {
            Reply::Answer(text) => {
                println!("{text}");
                Ok(())
            }
            Reply::Interrupted => bail!("interrupted"),
            Reply::Failed => bail!("the task failed"),
        }
    }

    /// Runs one user message to its answer.
    fn message(&mut self, text: &str) -> Result<Reply> {
        self.baseline = self.interrupts.load(Ordering::Acquire);
        self.history.push(Message::new(Role::User, text));
        let mut turn_stats = TurnStats::default();
        let mut reply = Reply::Failed;
        for step in 0..self.a.max_steps.max(1) {
            let choice = match (step, self.a.tool_choice.as_str()) {
                (_, "none") => ToolChoice::None,
                (_, "auto") | (1.., _) => ToolChoice::Auto,
                (0, "required") => ToolChoice::Required,
                (0, name) => ToolChoice::Named(name.to_string()),
            };
            match self.step(&choice, &mut turn_stats)? {
                Step::Calls => {
                    if step + 1 == self.a.max_steps {
                        self.ui.line(
                            Style::Dim,
                            &format!("(stopped after {} steps: --max-steps)", self.a.max_steps),
                        )?;
                        reply = Reply::Answer(String::new());
                    }
                }
                Step::Answer(text) => {
                    reply = Reply::Answer(text);
                    break;
                }
                Step::Interrupted => {
                    reply = Reply::Interrupted;
                    break;
                }
                Step::Failed => break,
            }
        }
        if let Some(usage) = &turn_stats.last {
            let status = self.status(usage, turn_stats.prefilled, turn_stats.generated);
            self.ui.line(Style::Dim, &status)?;
        }
        self.save_index(turn_stats.last.as_ref())?;
        Ok(reply)
    }

    /// One model turn: rendered, streamed, its calls run.
    fn step(&mut self, choice: &ToolChoice, stats: &mut TurnStats) -> Result<Step> {
        let calls = CallPlan::new(
            self.template.tool_syntax(),
            &self.tools,
            choice,
            self.think,
            // One call a turn: small models repeat a call they may repeat.
            false,
        );
        let mut prompt = self.render(&self.history, true);
        if let Some(f) = &calls.forced {
            prompt.markup(f);
        }
        let gate = match &calls.grammar {
            Some(plan) => {
                let vocab = self.vocab.get_or_init(|| {
                    ds4_runtime::vocab_for(&self.model, Some(self.template.as_ref()))
                });
                match ds4_runtime::compile(vocab.as_ref().map_err(String::as_str), plan) {
                    Ok(g) => Some(g),
                    Err(e) => {
                        self.ui
                            .line(Style::Dim, &format!("(tool calls unconstrained: {e})"))?;
                        None
                    }
                }
            }
            None => None,
        };
        let parser =
            (!self.tools.is_empty()).then(|| self.template.tool_syntax().parser(&self.tools));
        // Ids unique in the session: its length so far and the call's number.
        let (at, mut n) = (self.history.len(), 0);
        let mut shaper = Shaper::new(
            self.think,
            parser,
            calls.forced.as_deref(),
            Box::new(move || {
                n += 1;
                format!("call_{at}_{n}")
            }),
        );
        let rx = self.submit(
            &prompt,
            self.a.sampling.n_predict,
            gate,
            Some(SaveReason::AgentSession),
        )?;
        let bar_from = self.bar_from();
        let interrupts = Arc::clone(&self.interrupts);
        let ui = &mut self.ui;
        let thinking = &mut self.thinking;
        thinking.start_turn();
        let outcome = stream(rx, bar_from, Some((&interrupts, self.baseline)), |text| {
            for piece in shaper.push(text) {
                show(ui, piece, thinking)?;
            }
            Ok(())
        })?;
        let (usage, _finish) = match outcome {
            Outcome::Done { usage, finish, .. } => (usage, finish),
            Outcome::Failed(e) => {
                self.history.pop_if(|m| m.role == Role::User);
                self.ui.line(Style::Error, &format!("\nerror: {e}"))?;
                return Ok(Step::Failed);
            }
            Outcome::Interrupted => {
                self.ui.line(Style::Plain, "")?;
                return Ok(Step::Interrupted);
            }
        };
        let (tail, turn) = shaper.finish();
        for piece in tail {
            show(&mut self.ui, piece, &mut self.thinking)?;
        }
        self.thinking.end(&mut self.ui)?;
        self.ui.line(Style::Plain, "")?;
        stats.prefilled += usage.prompt_tokens - usage.cached_tokens;
        stats.generated += usage.completion_tokens;
        stats.last = Some(usage);
        let mut msg = Message::new(Role::Assistant, turn.content.clone());
        if !turn.reasoning.is_empty() {
            msg.reasoning = Some(turn.reasoning.clone());
        }
        if turn.calls.is_empty() {
            self.history.push(msg);
            return Ok(Step::Answer(turn.content));
        }
        msg.tool_calls = turn
            .calls
            .iter()
            .map(|c| ds4_chat::ToolCall {
                id: c.id.clone(),
                name: c.name.clone(),
                arguments: c.arguments.clone(),
            })
            .collect();
        msg.tool_calls_raw = Some(turn.calls_raw.clone());
        self.history.push(msg);
        for call in &turn.calls {
            let result = self.run_tool(&call.name, &call.arguments)?;
            let mut m = Message::new(Role::Tool, result);
            m.tool_call_id = Some(call.id.clone());
            m.name = Some(call.name.clone());
            self.history.push(m);
        }
        Ok(Step::Calls)
    }

    /// Runs one call (asking first when it changes things), its result or
    /// error as the model will read it.
    fn run_tool(&mut self, name: &str, arguments: &str) -> Result<String> {
        let action = match Action::parse(name, arguments) {
            Ok(a) => a,
            Err(e) => {
                self.ui.line(Style::Error, &format!("  {e}"))?;
                return Ok(format!("error: {e}"));
            }
        };
        if action.changes() && !self.a.yes {
            let question = format!("allow {}?", action.describe());
            if !self.ui.confirm(&question)? {
                self.ui.line(Style::Dim, "  refused")?;
                return Ok("error: the user refused this action".into());
            }
        }
        let result = match action.run(&self.ws, &self.limits) {
            Ok(r) => r,
            Err(e) => format!("error: {e}"),
        };
        let shown: Vec<&str> = result.lines().take(12).collect();
        let more = result.lines().count().saturating_sub(shown.len());
        let mut text = shown
            .iter()
            .map(|l| format!("  │ {l}"))
            .collect::<Vec<_>>()
            .join("\n");
        if more > 0 {
            text.push_str(&format!("\n  │ ... {more} more lines"));
        }
        self.ui.line(Style::Dim, &text)?;
        Ok(result)
    }

    /// The status line after a turn.
    fn status(&self, usage: &Usage, prefilled: usize, generated: usize) -> String {
        format!(
            "[{} · context {}/{} · cache {} · prefilled {prefilled} tokens · generated {generated}]",
            self.model_name,
            usage.prompt_tokens + usage.completion_tokens,
            self.n_ctx,
            usage.cache_source.as_str(),
        )
    }

    /// Writes the session's index (when it has a conversation), noting the
    /// checkpoint its state was saved to.
    fn save_index(&mut self, last: Option<&Usage>) -> Result<()> {
        if self.history.is_empty() {
            return Ok(());
        }
        self.session.set_messages(&self.history, now());
        if let Some(u) = last {
            self.session.tokens = u.prompt_tokens + u.completion_tokens;
        }
        let hash = hex(&ds4_kvstore::text_hash(
            self.state_text(&self.history).as_str().as_bytes(),
        ));
        if !self.session.checkpoints.contains(&hash) {
            self.session.checkpoints.push(hash);
        }
        self.session.stripped = false;
        self.index.save(&self.session)?;
        Ok(())
    }

    /// Runs a `/command`; `false` to quit.
    fn command(&mut self, line: &str) -> Result<bool> {
        let (cmd, arg) = match line.split_once(char::is_whitespace) {
            Some((c, a)) => (c, a.trim()),
            None => (line, ""),
        };
        let need_id = |arg: &str| -> Result<String> {
            match arg {
                "" => bail!("{cmd} needs a session id (see /list)"),
                id => Ok(id.to_string()),
            }
        };
        match cmd {
            "/exit" | "/quit" => return Ok(false),
            "/help" => self.ui.line(Style::Plain, HELP)?,
            "/new" => {
                self.save_index(None)?;
                self.history.clear();
                self.session = SessionRecord::new(self.index.fresh_id(), now());
                self.ui
                    .line(Style::Dim, &format!("new session {}", self.session.id))?;
            }
            "/save" => {
                self.save_index(None)?;
                self.ui.line(
                    Style::Plain,
                    &format!(
                        "saved session {} ({} tokens)",
                        self.session.id, self.session.tokens
                    ),
                )?;
            }
            "/list" => self.list()?,
            "/switch" => self.switch(&need_id(arg)?)?,
            "/del" => {
                let id = need_id(arg)?;
                let rec = self.index.load(&id)?;
                self.drop_checkpoints(&rec);
                self.index.remove(&id)?;
                self.ui
                    .line(Style::Plain, &format!("deleted session {id}"))?;
                if id == self.session.id {
                    self.history.clear();
                    self.session = SessionRecord::new(self.index.fresh_id(), now());
                }
            }
            "/strip" => {
                let id = need_id(arg)?;
                if id == self.session.id {
                    self.save_index(None)?;
                }
                let mut rec = self.index.load(&id)?;
                let n = self.drop_checkpoints(&rec);
                rec.checkpoints.clear();
                rec.stripped = true;
                self.index.save(&rec)?;
                if id == self.session.id {
                    self.session = rec;
                }
                self.ui.line(
                    Style::Plain,
                    &format!("stripped session {id}: {n} checkpoint(s) removed, text kept"),
                )?;
            }
            "/history" => {
                let lines: Vec<String> = self
                    .history
                    .iter()
                    .map(|m| {
                        let calls: Vec<String> = m
                            .tool_calls
                            .iter()
                            .map(|c| format!(" [{} {}]", c.name, c.arguments))
                            .collect();
                        format!("{}: {}{}", m.role.as_str(), m.content, calls.concat())
                    })
                    .collect();
                self.ui.line(Style::Plain, &lines.join("\n"))?;
            }
            "/compact" => self.compact()?,
            "/think" => match self.thinking.last.as_str() {
                "" => self.ui.line(Style::Dim, "(the last turn did not think)")?,
                r => self.ui.line(Style::Dim, r)?,
            },
            "/thinking" => {
                self.thinking.collapsed = !self.thinking.collapsed;
                let now = match self.thinking.collapsed {
                    true => "thinking collapsed to one line per turn (/think shows it)",
                    false => "thinking streamed dimmed",
                };
                self.ui.line(Style::Dim, now)?;
            }
            _ => bail!("unknown command {cmd} (/help lists them)"),
        }
        Ok(true)
    }

    /// Removes a session's checkpoints from the store (never the system's).
    fn drop_checkpoints(&self, rec: &SessionRecord) -> usize {
        rec.checkpoints
            .iter()
            .filter(|h| **h != self.system_hash)
            .filter(|h| self.store.remove(h).unwrap_or(false))
            .count()
    }

    fn list(&mut self) -> Result<()> {
        let now = now();
        let mut lines = vec![format!(
            "  {:<8}  {:>7}  {:>6}  {:>9}  title",
            "id", "tokens", "age", "size"
        )];
        for rec in self.index.list()? {
            let size: u64 = rec
                .checkpoints
                .last()
                .and_then(|h| std::fs::metadata(self.store.dir().join(format!("{h}.kv"))).ok())
                .map_or(0, |m| m.len());
            let size = match (rec.stripped, size) {
                (true, _) => "stripped".to_string(),
                (false, 0) => "-".to_string(),
                (false, b) => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
            };
            let mark = if rec.id == self.session.id { '*' } else { ' ' };
            lines.push(format!(
                "{mark} {:<8}  {:>7}  {:>6}  {:>9}  {}",
                rec.id,
                rec.tokens,
                age(now.saturating_sub(rec.updated)),
                size,
                rec.title
            ));
        }
        self.ui.line(Style::Plain, &lines.join("\n"))
    }

    /// Continues session `id`: its state loaded from its checkpoint (nothing
    /// prefilled), or prefilled again when it was stripped.
    fn switch(&mut self, id: &str) -> Result<()> {
        let rec = self.index.load(id)?;
        self.save_index(None)?;
        let history = rec.messages.clone();
        let prompt = self.state_text(&history);
        let rx = self.submit(&prompt, 0, None, Some(SaveReason::AgentSession))?;
        let outcome = stream(rx, self.bar_from(), None, |_| Ok(()))?;
        let Outcome::Done { usage, .. } = outcome else {
            bail!("restoring session {id} failed");
        };
        self.session = rec;
        self.history = history;
        let prefilled = usage.prompt_tokens - usage.cached_tokens;
        let words = match (prefilled, self.session.stripped) {
            (0, _) => crate::turns::source_words(&usage),
            (n, true) => format!("its checkpoint was stripped: re-prefilled {n} tokens"),
            (n, false) => format!("re-prefilled {n} tokens"),
        };
        self.ui.line(
            Style::Plain,
            &format!("switched to session {id} ({}): {words}", self.session.title),
        )?;
        let status = self.status(&usage, prefilled, 0);
        self.ui.line(Style::Dim, &status)?;
        self.save_index(Some(&usage))?;
        Ok(())
    }

    /// Summarises the session with the model into a new session that starts
    /// from the summary.
    fn compact(&mut self) -> Result<()> {
        if self.history.is_empty() {
            bail!("nothing to compact");
        }
        self.baseline = self.interrupts.load(Ordering::Acquire);
        self.save_index(None)?;
        let mut ask = self.history.clone();
        ask.push(Message::new(Role::User, COMPACT_REQUEST));
        let prompt = self.render(&ask, true);
        let rx = self.submit(&prompt, self.a.sampling.n_predict, None, None)?;
        let mut summary = String::new();
        let bar_from = self.bar_from();
        let ui = &mut self.ui;
        let interrupts = Arc::clone(&self.interrupts);
        let outcome = stream(rx, bar_from, Some((&interrupts, self.baseline)), |t| {
            summary.push_str(t);
            ui.write(Style::Dim, t)
        })?;
        self.ui.line(Style::Plain, "")?;
        if !matches!(outcome, Outcome::Done { .. }) {
            bail!("the summary did not finish");
        }
        let from = self.session.id.clone();
        let title = format!("compact of {}", self.session.title);
        self.session = SessionRecord::new(self.index.fresh_id(), now());
        self.session.title = title;
        self.history = vec![Message::new(
            Role::User,
            format!("Summary of the earlier session {from}:\n{}", summary.trim()),
        )];
        self.save_index(None)?;
        self.ui.line(
            Style::Plain,
            &format!(
                "compacted into new session {} (from {from})",
                self.session.id
            ),
        )
    }

    /// Saves the index and stops the runtime (its slot saved at shutdown).
    fn close(&mut self) -> Result<()> {
        self.save_index(None)?;
        if let Some(r) = self.runtime.take() {
            r.join();
        }
        Ok(())
    }
}

/// `--tool-choice`: auto, required, none or a tool's name.
fn tool_choice(s: &str) -> Result<String, String> {
    let names: Vec<String> = specs().into_iter().map(|t| t.name).collect();
    match s {
        "auto" | "required" | "none" => Ok(s.to_string()),
        _ if names.iter().any(|n| n == s) => Ok(s.to_string()),
        _ => Err(format!(
            "expected auto, required, none or a tool ({})",
            names.join(", ")
        )),
    }
}

/// How one model turn ended.
enum Step {
    /// It made calls, which ran.
    Calls,
    Answer(String),
    Interrupted,
    Failed,
}

/// How a user message ended.
enum Reply {
    Answer(String),
    Interrupted,
    Failed,
}

/// Token counts over the model turns of one message.
#[derive(Default)]
struct TurnStats {
    prefilled: usize,
    generated: usize,
    last: Option<Usage>,
}

/// How a turn's thinking is shown: streamed dimmed, or collapsed to one
/// line once it ends (kept whole for `/think`).
#[derive(Default)]
struct Thinking {
    collapsed: bool,
    /// This turn's reasoning so far (the last turn's once it ended).
    last: String,
    /// Reasoning is being shown or counted and has not ended yet.
    open: bool,
}

impl Thinking {
    fn start_turn(&mut self) {
        self.last.clear();
        self.open = false;
    }

    /// The reasoning ended (an answer, a call or the turn's end follows):
    /// a newline after streamed thinking, the one-line summary of collapsed.
    fn end(&mut self, ui: &mut Ui) -> Result<()> {
        if !std::mem::take(&mut self.open) {
            return Ok(());
        }
        if self.collapsed {
            let words = self.last.split_whitespace().count();
            ui.line(
                Style::Dim,
                &format!("▸ thought {words} words (/think shows them)"),
            )
        } else {
            ui.write(Style::Plain, "\n")
        }
    }
}

/// Shows a piece of a turn: reasoning dimmed (or collapsed), text as is, a
/// call on a line.
fn show(ui: &mut Ui, piece: Piece, thinking: &mut Thinking) -> Result<()> {
    match piece {
        Piece::Reasoning(r) => {
            thinking.open = true;
            thinking.last.push_str(&r);
            match thinking.collapsed {
                true => Ok(()),
                false => ui.write(Style::Dim, &r),
            }
        }
        Piece::Text(t) => {
            thinking.end(ui)?;
            ui.write(Style::Plain, &t)
        }
        Piece::Call(_, c) => {
            let streamed = thinking.open && !thinking.collapsed;
            thinking.end(ui)?;
            if !streamed {
                ui.line(Style::Plain, "")?;
            }
            ui.write(Style::Tool, &format!("→ {} {}", c.name, c.arguments))
        }
    }
}

/// Counts SIGINTs in `n` (Ctrl-C while a turn runs; at the line editor's
/// prompt Ctrl-C is a key it reports itself), from the moment this returns.
/// Called once the line editor exists: the editor puts its own SIGINT handler
/// in place when it is created, over whatever was there, while a handler
/// registered after it chains to it. Registered first (on a thread that raced
/// the editor's creation), a turn's Ctrl-C was sometimes lost.
fn count_interrupts(n: &Arc<AtomicUsize>) -> Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let seen = Arc::clone(n);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut sigint = {
        let _in_runtime = rt.enter();
        signal(SignalKind::interrupt())?
    };
    std::thread::spawn(move || {
        rt.block_on(async {
            while sigint.recv().await.is_some() {
                seen.fetch_add(1, Ordering::AcqRel);
            }
        });
    });
    Ok(())
}

fn now() -> u64 {
    ds4_kvstore::now_unix()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `s` seconds as `42s`, `5m`, `3h`, `2d`.
fn age(s: u64) -> String {
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}
