//! ChatML (`<|im_start|>role\n...<|im_end|>\n`), the template of SmolLM2 and the
//! Qwen family. SmolLM2's GGUF template inserts a default system message when the
//! conversation has none; that message is read from the template text itself.

use crate::{Message, Role};

const IM_START: &str = "<|im_start|>";
const IM_END: &str = "<|im_end|>";

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChatMl {
    /// Inserted as the first message when the conversation starts without one.
    pub default_system: Option<String>,
}

impl ChatMl {
    /// Recognises a ChatML Jinja template and extracts its default system message
    /// (the literal `<|im_start|>system\n...<|im_end|>` inside it), if any.
    pub fn from_template(template: &str) -> Option<Self> {
        if !template.contains(IM_START) || !template.contains(IM_END) {
            return None;
        }
        let marker = format!("{IM_START}system\n");
        let default_system = template.find(&marker).and_then(|i| {
            let rest = &template[i + marker.len()..];
            let end = rest.find(IM_END)?;
            let text = &rest[..end];
            // A Jinja expression there means the system text comes from the messages.
            (!text.contains("{{") && !text.contains("+")).then(|| text.to_string())
        });
        Some(ChatMl { default_system })
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends with an open
    /// assistant turn.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> String {
        let mut out = String::new();
        if let (Some(sys), Some(first)) = (&self.default_system, messages.first()) {
            if first.role != Role::System {
                push_turn(&mut out, Role::System.as_str(), sys);
            }
        }
        for m in messages {
            push_turn(&mut out, m.role.as_str(), &m.content);
        }
        if add_generation_prompt {
            out.push_str(IM_START);
            out.push_str("assistant\n");
        }
        out
    }
}

fn push_turn(out: &mut String, role: &str, content: &str) {
    out.push_str(IM_START);
    out.push_str(role);
    out.push('\n');
    out.push_str(content);
    out.push_str(IM_END);
    out.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn smollm2_template_matches_the_golden_prompts() {
        let t = ChatMl::from_template(SMOLLM2_TEMPLATE).unwrap();
        assert_eq!(
            t.default_system.as_deref(),
            Some("You are a helpful AI assistant named SmolLM, trained by Hugging Face")
        );
        let p = t.render(&[Message::new(Role::User, "What is 2+2?")], true);
        assert_eq!(
            p,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
        let with_system = t.render(
            &[
                Message::new(Role::System, "Be brief."),
                Message::new(Role::User, "Hi"),
            ],
            false,
        );
        assert_eq!(
            with_system,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
    }

    #[test]
    fn rendering_is_append_only() {
        let t = ChatMl::from_template(SMOLLM2_TEMPLATE).unwrap();
        let mut msgs = vec![Message::new(Role::User, "one")];
        let a = t.render(&msgs, true);
        msgs.push(Message::new(Role::Assistant, "two"));
        msgs.push(Message::new(Role::User, "three"));
        let b = t.render(&msgs, true);
        assert!(b.starts_with(&a));
    }

    #[test]
    fn other_templates_are_not_chatml() {
        assert_eq!(
            ChatMl::from_template("{{ bos_token }}<start_of_turn>user"),
            None
        );
        let plain = ChatMl::from_template(
            "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'}}",
        );
        assert_eq!(
            plain,
            Some(ChatMl {
                default_system: None
            })
        );
    }
}
