"""Drives a running Tandem cluster with the official `openai` client and prints what came back as JSON.

Usage: python openai_client.py BASE_URL PROMPT MAX_TOKENS [COMPLETION_PROMPT_IDS_JSON]
"""

import json
import sys

from openai import OpenAI


def entry(e) -> dict:
    """One token's log-probabilities as plain data."""
    return {"token": e.token, "bytes": e.bytes, "logprob": e.logprob,
            "top": [[t.token, t.logprob] for t in e.top_logprobs]}


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

    # Log-probabilities, whole and streamed, with three alternatives per token.
    with_logprobs = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=messages, temperature=0, max_tokens=max_tokens,
        logprobs=True, top_logprobs=3,
    )
    whole_logprobs = [entry(e) for e in with_logprobs.choices[0].logprobs.content]
    streamed_logprobs = []
    for chunk in client.chat.completions.create(
        model="smollm2-135m-instruct", messages=messages, temperature=0, max_tokens=max_tokens,
        logprobs=True, top_logprobs=3, stream=True,
    ):
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                streamed_logprobs.extend(entry(e) for e in choice.logprobs.content)

    # A penalty changes the greedy answer; a prompt given as token ids is the same prompt as its text.
    listing = [{"role": "user", "content": "List the days of the week, one per line."}]
    plain, penalized = (
        client.chat.completions.create(
            model="smollm2-135m-instruct", messages=listing, temperature=0, max_tokens=40,
            frequency_penalty=penalty, presence_penalty=penalty,
        ).choices[0].message.content
        for penalty in (0.0, 2.0)
    )
    # Two samples of a structured output, with thinking turned off as Qwen3's templates take it (under
    # `--reasoning-parser qwen3` the answer may otherwise think first, and this model would not stop).
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "rank"], "additionalProperties": False}
    structured = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Name a city and rank it."}],
        temperature=1.0, seed=2, n=2, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    # A forced tool call, whole and streamed (the stream's pieces put together as clients put them together).
    tools = [{"type": "function", "function": {
        "name": "weather", "description": "Today's weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                       "required": ["city"], "additionalProperties": False}}}]
    asked = [{"role": "user", "content": "What is the weather in Paris? Call weather with the city."}]
    forced = {"type": "function", "function": {"name": "weather"}}
    called = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=asked, temperature=0, max_tokens=40, tools=tools, tool_choice=forced,
    ).choices[0]
    tool_call = {"finish": called.finish_reason, "content": called.message.content,
                 "calls": [[c.id, c.type, c.function.name, c.function.arguments] for c in called.message.tool_calls]}
    pieces = {}
    for chunk in client.chat.completions.create(
        model="smollm2-135m-instruct", messages=asked, temperature=0, max_tokens=40, tools=tools,
        tool_choice=forced, stream=True,
    ):
        for choice in chunk.choices:
            for c in choice.delta.tool_calls or []:
                call = pieces.setdefault(c.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = c.id or call["id"]
                call["name"] = (c.function.name if c.function else None) or call["name"]
                call["arguments"] += (c.function.arguments if c.function else None) or ""
    tool_call["streamed"] = [[p["name"], p["arguments"]] for _, p in sorted(pieces.items())]
    required = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=asked, temperature=0, max_tokens=60, tools=tools,
        tool_choice="required", parallel_tool_calls=False,
    ).choices[0]
    tool_call["required"] = [required.finish_reason,
                             [[c.function.name, c.function.arguments] for c in required.message.tool_calls or []]]
    # Tools without tool_choice (auto, served by `tandem up --tool-call-parser hermes`): the model's own call, which a
    # regular expression makes the small model write, parsed out of its text beside the words before it.
    chosen = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=asked, temperature=0, max_tokens=60, tools=tools,
        extra_body={"structured_outputs": {"regex": 'Sure\\. <tool_call>\\{"name": "weather", "arguments": '
                                                    '\\{"city": "Paris"\\}\\}</tool_call>'}},
    ).choices[0]
    tool_call["auto"] = [chosen.finish_reason, chosen.message.content,
                         [[c.function.name, c.function.arguments] for c in chosen.message.tool_calls or []]]

    # A reasoning model's thinking (`tandem up --reasoning-parser qwen3`), which the small model writes when shown
    # two turns that think first: the client sees it as the message's extra field, apart from the content, whole and
    # streamed; a regular expression holds the answer after it.
    shown = [
        {"role": "system", "content": "Think first inside <think> and </think>, then answer."},
        {"role": "user", "content": "Where is Rome?"},
        {"role": "assistant", "content": "<think>\nRome is in Italy.\n</think>\n\nItaly."},
        {"role": "user", "content": "Where is Madrid?"},
        {"role": "assistant", "content": "<think>\nMadrid is in Spain.\n</think>\n\nSpain."},
        {"role": "user", "content": "Where is Paris?"},
    ]
    think = {"structured_outputs": {"regex": "France\\."}}
    thought = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=shown, temperature=0, max_tokens=40, extra_body=think,
    ).choices[0].message
    streamed_thought = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(
        model="smollm2-135m-instruct", messages=shown, temperature=0, max_tokens=40, extra_body=think, stream=True,
    ):
        delta = chunk.choices[0].delta
        streamed_thought["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
        streamed_thought["content"] += delta.content or ""
    reasoning = {"whole": [(thought.model_extra or {}).get("reasoning_content"), thought.content],
                 "streamed": [streamed_thought["reasoning_content"], streamed_thought["content"]]}

    # The Responses API: the same answer, whole (the client's `output_text`) and from its typed events.
    answer = client.responses.create(
        model="smollm2-135m-instruct", input=prompt, temperature=0, max_output_tokens=max_tokens
    )
    deltas, last = [], None
    for event in client.responses.create(
        model="smollm2-135m-instruct", input=prompt, temperature=0, max_output_tokens=max_tokens, stream=True
    ):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        last = event.type
    responses = {"whole": answer.output_text, "status": answer.status, "streamed": "".join(deltas), "last": last,
                 "usage": [answer.usage.input_tokens, answer.usage.output_tokens]}
    # Stored: read back, gone on from (the conversation kept by the router), deleted.
    responses["retrieved"] = client.responses.retrieve(answer.id).output_text
    follow = client.responses.create(
        model="smollm2-135m-instruct", previous_response_id=answer.id, input="Say it again.", temperature=0,
        max_output_tokens=8,
    )
    responses["followed"] = [follow.previous_response_id == answer.id, bool(follow.output_text)]
    client.responses.delete(answer.id)
    try:
        client.responses.retrieve(answer.id)
        responses["deleted"] = False
    except Exception as e:  # the client raises NotFoundError for a 404
        responses["deleted"] = type(e).__name__

    by_ids = None
    if len(sys.argv) > 4:
        ids = json.loads(sys.argv[4])
        c = client.completions.create(
            model="smollm2-135m-instruct", prompt=ids, temperature=0, max_tokens=4, logprobs=2
        )
        lp = c.choices[0].logprobs
        by_ids = {"text": c.choices[0].text, "tokens": lp.tokens, "token_logprobs": lp.token_logprobs,
                  "top_logprobs": lp.top_logprobs, "text_offset": lp.text_offset}

    try:
        client.chat.completions.create(model="no-such-model", messages=messages)
        unknown_model = None
    except Exception as e:  # the client raises NotFoundError for a 404
        unknown_model = type(e).__name__

    # A prompt scored as evaluation harnesses score one: echoed with its log-probabilities, nothing generated.
    scored = None
    if by_ids is not None:
        c = client.completions.create(
            model="smollm2-135m-instruct", prompt=ids, temperature=0, max_tokens=0, echo=True, logprobs=1
        )
        lp = c.choices[0].logprobs
        scored = {"text": c.choices[0].text, "finish": c.choices[0].finish_reason, "tokens": lp.tokens,
                  "token_logprobs": lp.token_logprobs, "top_logprobs": lp.top_logprobs,
                  "completion_tokens": c.usage.completion_tokens}

    # A prompt over the context is a bad request whose code says so, as OpenAI's API answers.
    try:
        client.completions.create(model="smollm2-135m-instruct", prompt="word " * 9000, max_tokens=1)
        too_long = None
    except Exception as e:
        too_long = [type(e).__name__, getattr(e, "code", None)]

    models = [m.id for m in client.models.list()]
    retrieved = client.models.retrieve("smollm2-135m-instruct").id
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
                "whole_logprobs": whole_logprobs,
                "streamed_logprobs": streamed_logprobs,
                "unpenalized": plain,
                "penalized": penalized,
                "by_ids": by_ids,
                "scored": scored,
                "too_long": too_long,
                "structured": [c.message.content for c in structured.choices],
                "tool_call": tool_call,
                "reasoning": reasoning,
                "responses": responses,
                "unknown_model": unknown_model,
                "models": models,
                "retrieved": retrieved,
            }
        )
    )


if __name__ == "__main__":
    main()
