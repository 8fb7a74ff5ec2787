//! Which chat template a model is rendered with (the server and `ds4 chat`
//! agree on it).

use ds4_chat::{ChatMl, DeepSeek, Template};
use ds4_engine::Model;

/// The chat template a model is served with: its family's own where the family
/// has one (DeepSeek V4), else the GGUF's `chat_template` when it is ChatML;
/// `None` when neither (completions only).
pub fn template_for(model: &Model) -> Option<Box<dyn Template>> {
    match model.family_name() {
        "deepseek4" => Some(Box::new(DeepSeek)),
        _ => model
            .chat_template()
            .and_then(ChatMl::from_template)
            .map(|t| Box::new(t) as Box<dyn Template>),
    }
}
