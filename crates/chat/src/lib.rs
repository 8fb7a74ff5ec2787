//! Conversations and the prompt renderers of the model families. A renderer turns
//! messages into the exact prompt text the model was trained on; rendering is
//! append-only (a longer conversation renders to a longer text with the shorter one
//! as its prefix), which is what lets a live session extend instead of re-prefill.

mod chatml;

pub use chatml::ChatMl;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: Role,
    pub content: String,
}

impl Message {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message {
            role,
            content: content.into(),
        }
    }
}
