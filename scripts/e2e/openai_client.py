"""Drives a running Tandem cluster with the official `openai` client and prints what came back as JSON.

Usage: python openai_client.py BASE_URL PROMPT MAX_TOKENS
"""

import json
import sys

from openai import OpenAI


def main() -> None:
    base_url, prompt, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": prompt}]

    whole = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=messages, temperature=0, max_tokens=max_tokens
    )

    chunks = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=messages,
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    streamed, usage, finish = [], None, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                streamed.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason

    completion = client.completions.create(
        model="smollm2-135m-instruct", prompt="The capital of France is", temperature=0, max_tokens=4
    )

    try:
        client.chat.completions.create(model="no-such-model", messages=messages)
        unknown_model = None
    except Exception as e:  # the client raises NotFoundError for a 404
        unknown_model = type(e).__name__

    models = [m.id for m in client.models.list()]
    print(
        json.dumps(
            {
                "whole": whole.choices[0].message.content,
                "whole_finish": whole.choices[0].finish_reason,
                "whole_usage": whole.usage.model_dump(),
                "streamed": "".join(streamed),
                "streamed_finish": finish,
                "streamed_usage": usage.model_dump() if usage else None,
                "completion": completion.choices[0].text,
                "unknown_model": unknown_model,
                "models": models,
            }
        )
    )


if __name__ == "__main__":
    main()
