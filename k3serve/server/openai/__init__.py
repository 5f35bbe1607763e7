"""The OpenAI-compatible API: its protocol (request and response models), the serving of
completions, chat and Responses, logprobs, errors, media parts and batch files."""
