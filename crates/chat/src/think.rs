//! Thinking modes: whether the assistant turn opens with hidden reasoning.

/// How the assistant turn is prompted (see the system spec §5.1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ThinkMode {
    /// Direct answer.
    #[default]
    None,
    /// Normal thinking.
    High,
    /// Maximum effort (families that have it; otherwise treated as `High`).
    Max,
}
