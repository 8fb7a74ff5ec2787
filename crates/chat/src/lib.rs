//! Conversations and the prompt renderers of the model families. A renderer turns
//! messages into the exact prompt text the model was trained on; rendering is
//! append-only (a longer conversation renders to a longer text with the shorter one
//! as its prefix), which is what lets a live session extend instead of re-prefill.
//!
//! Tool calling lives in [`tools`]: each family's call syntax renders calls and
//! parses generated text back into calls, incrementally; [`turn`] shapes a
//! generated turn into reasoning, text and calls.

mod chatml;
mod deepseek;
mod prompt;
pub mod think;
pub mod tools;
pub mod turn;

pub use chatml::ChatMl;
pub use deepseek::DeepSeek;
pub use prompt::Prompt;
pub use think::{
    ThinkControl, ThinkEvent, ThinkMode, ThinkRequest, ThinkSplit, ThinkSplitter, UnknownEffort,
};
pub use tools::{ToolCall, ToolChoice, ToolSpec};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    #[default]
    User,
    Assistant,
    /// A tool result (OpenAI `tool` / `function`, Anthropic `tool_result` blocks).
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Message {
    pub role: Role,
    pub content: String,
    /// Assistant reasoning the client sent back (`reasoning_content`, thinking blocks).
    pub reasoning: Option<String>,
    /// Assistant tool calls, in order.
    pub tool_calls: Vec<ToolCall>,
    /// The exact text the model sampled for `tool_calls` (everything after the
    /// content), when the server remembers it: rendered verbatim instead of the
    /// canonical form, so resent history stays byte-identical to the live state.
    pub tool_calls_raw: Option<String>,
    /// For a tool result: the id of the call it answers.
    pub tool_call_id: Option<String>,
    /// For a tool result: the tool's name, when the client gives it.
    pub name: Option<String>,
}

impl Message {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message {
            role,
            content: content.into(),
            ..Default::default()
        }
    }
}

/// What a render needs besides the messages.
#[derive(Clone, Copy, Debug)]
pub struct RenderOptions<'a> {
    /// Active tool schemas (empty when the request has none or `tool_choice` is none).
    pub tools: &'a [ToolSpec],
    pub think: ThinkMode,
    /// End with an open assistant turn.
    pub add_generation_prompt: bool,
}

impl Default for RenderOptions<'_> {
    fn default() -> Self {
        RenderOptions {
            tools: &[],
            think: ThinkMode::None,
            add_generation_prompt: true,
        }
    }
}

/// A model family's chat format: how a conversation becomes prompt text and how
/// that family writes tool calls.
pub trait Template: Send + Sync {
    /// A short name for logs and traces (`chatml`, `deepseek`).
    fn name(&self) -> &'static str;
    /// The prompt: the template's markup around the conversation's content
    /// (see [`Prompt`]).
    fn render(&self, messages: &[Message], opts: &RenderOptions) -> Prompt;
    /// The family's tool-call syntax.
    fn tool_syntax(&self) -> &dyn tools::ToolSyntax;
    /// Whether the family has a thinking mode (otherwise thinking requests are
    /// accepted and rendered as non-thinking).
    fn supports_thinking(&self) -> bool;
    /// The text of the token that ends an assistant turn (what a finished
    /// constrained answer must end with).
    fn end_of_turn(&self) -> &'static str;
}
