"""The API process: OpenAI routes, tokenization, detokenization, balancing.

Never imports torch (it must stay small and start fast).
"""
