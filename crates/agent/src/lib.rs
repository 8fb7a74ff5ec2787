//! The library side of `ds4 agent`, a terminal coding agent: its tools and
//! their confinement to one working directory ([`tools`], [`confine`]), and
//! the index of its sessions ([`sessions`]: each conversation's messages and
//! title next to the checkpoint that holds its state). The loop, the line
//! editor and the rendering are the binary's; nothing here prints.

pub mod confine;
pub mod sessions;
pub mod tools;

pub use confine::Workspace;
pub use sessions::{SessionError, SessionIndex, SessionRecord};
pub use tools::{Action, Limits, ToolError};
