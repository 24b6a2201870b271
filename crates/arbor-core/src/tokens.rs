//! Token estimation: about one token per four characters, the rule the
//! context manager uses between provider-reported counts.

use std::borrow::Borrow;

use crate::message::Message;

/// Estimated tokens for `chars` characters of text.
pub fn estimate_from_chars(chars: usize) -> u64 {
    (chars as u64).div_ceil(4)
}

/// Estimated input tokens for a list of messages (plus a small per-message
/// overhead for the role and framing each provider adds).
pub fn estimate_messages<M: Borrow<Message>>(messages: &[M]) -> u64 {
    messages.iter().map(|message| estimate_message(message.borrow())).sum()
}

/// Estimated input tokens for one message, framing included.
pub fn estimate_message(message: &Message) -> u64 {
    4 + estimate_from_chars(message.char_len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_characters_make_a_token() {
        assert_eq!(estimate_from_chars(0), 0);
        assert_eq!(estimate_from_chars(4), 1);
        assert_eq!(estimate_from_chars(5), 2);
        assert_eq!(estimate_messages(&[Message::user("abcdefgh")]), 6);
    }
}
