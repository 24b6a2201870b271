//! OpenAI Chat Completions adapter (also any OpenAI-compatible server).
//! Being written: see the provider issue.
