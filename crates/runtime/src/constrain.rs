//! What a turn's output is held to, shared by the server and the agent: the
//! forced opening of a tool call and the call grammar (`tool_choice`
//! required or named: from the first token; auto: once the model writes the
//! syntax's trigger itself), structured output, and their compilation into a
//! [`Gate`] over the model's vocabulary.

use std::sync::Arc;

use ds4_chat::tools::{ToolChoice, ToolSyntax};
use ds4_chat::{Template, ThinkMode, ToolSpec};
use ds4_engine::Model;
use ds4_grammar::{GrammarError, Vocab};

use crate::job::Gate;

/// What the output of a turn is held to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GrammarPlan {
    /// A forced tool call (the prompt ends with the call's opening): the
    /// family's call grammar from the first token.
    ForcedCall(String),
    /// Tools offered, the model free to call one: the call grammar once it
    /// writes the opening (`trigger`) itself.
    Call {
        trigger: &'static str,
        grammar: String,
    },
    /// Structured output: JSON valid against a schema.
    Json(String),
}

/// A turn's tool calling: the opening the prompt ends with when a call is
/// forced, and the call grammar.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CallPlan {
    /// Markup to append to the prompt (after an empty reasoning block in
    /// thinking mode: a call inside the reasoning would never be read).
    pub forced: Option<String>,
    /// `ForcedCall` with `forced`, else `Call` where the syntax has a
    /// trigger; `None` when no call may be made or the syntax has no grammar.
    pub grammar: Option<GrammarPlan>,
}

impl CallPlan {
    /// The plan for offering `tools` under `choice` in `syntax`, the turn
    /// rendered in `think` mode; `parallel` allows several calls in a turn.
    pub fn new(
        syntax: &dyn ToolSyntax,
        tools: &[ToolSpec],
        choice: &ToolChoice,
        think: ThinkMode,
        parallel: bool,
    ) -> CallPlan {
        if tools.is_empty() {
            return CallPlan::default();
        }
        let forced = syntax
            .forced_prefix(choice)
            .map(|f| match think.is_thinking() {
                true => format!("{}{f}", ds4_chat::think::THINK_CLOSE),
                false => f,
            });
        let grammar = match (
            &forced,
            syntax.call_grammar(tools, choice, parallel),
            syntax.call_trigger(),
        ) {
            (Some(_), Some(g), _) => Some(GrammarPlan::ForcedCall(g)),
            (None, Some(grammar), Some(trigger)) => Some(GrammarPlan::Call { trigger, grammar }),
            _ => None,
        };
        CallPlan { forced, grammar }
    }
}

/// The vocabulary constrained decoding runs over for `model` rendered with
/// `template`: a finished grammar must end the turn (the template's
/// end-of-turn token, or the vocabulary's end of text for raw completions).
/// `Err` says why there is none.
pub fn vocab_for(model: &Arc<Model>, template: Option<&dyn Template>) -> Result<Vocab, String> {
    let end_of_turn = template
        .and_then(|t| model.tokenizer.token_id(t.end_of_turn()))
        .or(model.tokenizer.eos());
    match end_of_turn {
        Some(id) => Vocab::new(Arc::clone(model), id).map_err(|e| e.to_string()),
        None => Err("the model has no end-of-turn token".to_string()),
    }
}

/// Why a plan has no gate.
#[derive(Debug, thiserror::Error)]
pub enum GateError {
    /// The model has no vocabulary for constrained decoding.
    #[error("constrained decoding is not available for this model: {0}")]
    NoVocab(String),
    /// The grammar does not compile (a schema the engine cannot hold).
    #[error(transparent)]
    Grammar(#[from] GrammarError),
}

/// Compiles `plan` over `vocab` (from [`vocab_for`]).
pub fn compile(vocab: Result<&Vocab, &str>, plan: &GrammarPlan) -> Result<Gate, GateError> {
    let vocab = vocab.map_err(|why| GateError::NoVocab(why.to_string()))?;
    let (text, trigger) = match plan {
        GrammarPlan::ForcedCall(g) | GrammarPlan::Json(g) => (g, None),
        GrammarPlan::Call { trigger, grammar } => (grammar, Some(*trigger)),
    };
    Ok(Gate {
        constraint: vocab.constraint(text)?,
        trigger,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_chat::tools::Hermes;

    fn tool() -> ToolSpec {
        ToolSpec {
            name: "ls".into(),
            description: String::new(),
            parameters: r#"{"type":"object","properties":{"dir":{"type":"string"}}}"#.into(),
            raw: String::new(),
        }
    }

    #[test]
    fn a_forced_call_opens_the_turn_and_auto_waits_for_the_trigger() {
        let tools = [tool()];
        let plan = CallPlan::new(
            &Hermes,
            &tools,
            &ToolChoice::Required,
            ThinkMode::None,
            true,
        );
        assert_eq!(plan.forced, Hermes.forced_prefix(&ToolChoice::Required));
        assert!(matches!(plan.grammar, Some(GrammarPlan::ForcedCall(_))));
        let thinking = CallPlan::new(
            &Hermes,
            &tools,
            &ToolChoice::Required,
            ThinkMode::High,
            true,
        );
        assert!(thinking
            .forced
            .is_some_and(|f| f.starts_with(ds4_chat::think::THINK_CLOSE)));
        let auto = CallPlan::new(&Hermes, &tools, &ToolChoice::Auto, ThinkMode::None, true);
        assert_eq!(auto.forced, None);
        assert!(matches!(auto.grammar, Some(GrammarPlan::Call { .. })));
        assert_eq!(
            CallPlan::new(&Hermes, &tools, &ToolChoice::None, ThinkMode::None, true),
            CallPlan::default()
        );
        assert_eq!(
            CallPlan::new(&Hermes, &[], &ToolChoice::Required, ThinkMode::None, true),
            CallPlan::default()
        );
    }
}
