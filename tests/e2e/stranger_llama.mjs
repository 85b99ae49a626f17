// llama.cpp on a lodger GGUF, as a stranger runs it: node-llama-cpp's prebuilt CPU build of llama.cpp
// (the npm package @node-llama-cpp/linux-x64, installed by `make test` into tests/node-llama-cpp), never
// lodger, never Python. stranger.py runs it and hands it, as JSON on stdin, the GGUF's path, the chat
// prompt's text, the merged tokenizer's ids for it, how many tokens to generate and the thread count.
// It prints one JSON object: llama.cpp's own tokens for the prompt text, its logits at every position
// of those ids (with prompt_logits), its greedy continuation of them (llama.cpp's sampler at
// temperature 0) and the raw logits each token was chosen from.
//
// The context keeps its KV cache in f32 with flash attention off: llama.cpp's defaults (an f16 cache,
// flash attention where it can) move this tiny model's logits by up to 1e-4, where f32 agrees with
// transformers to about 1e-7, so the comparison can be tight.
import {pathToFileURL} from "node:url";
import path from "node:path";
import fs from "node:fs";

const args = JSON.parse(fs.readFileSync(0, "utf8"));
const entry = path.join(args.runtime, "node_modules", "node-llama-cpp", "dist", "index.js");
const {getLlama, LlamaLogLevel} = await import(pathToFileURL(entry).href);

// build "never": the prebuilt binaries or an error, never a compile of llama.cpp's sources
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath: args.gguf});
const context = await model.createContext({
    contextSize: 512, threads: args.threads, flashAttention: false,
    experimentalKvCacheKeyType: "F32", experimentalKvCacheValueType: "F32",
});
const sequence = context.getSequence();

// {token id: logit}. All of the vocabulary, or (top > 0) its `top` best: node-llama-cpp hands logits over
// as a Map sorted by value, which for SmolLM2's 49,152 tokens costs 1.6 s a step here, 0.05 s for 64.
const wanted = args.top > 0 ? {filter: {includeTop: args.top}} : true;
const byToken = (logits) => Object.fromEntries(logits);

// The prompt in one batch (its logits kept at every position when asked), then one token at a time,
// each chosen by llama.cpp's sampler at temperature 0 (greedy) from the logits it reports.
const greedy = [], logits = [];
let promptLogits = null, pending = args.prompt_ids;
while (greedy.length < args.new_tokens) {
    const last = pending.length - 1;
    const items = pending.map((token, i) => i === last
        ? [token, {generateNext: {token: true, logits: wanted, options: {temperature: 0}}}]
        : args.prompt_logits ? [token, {generateNext: {logits: wanted}}] : token);
    const outputs = await sequence.controlledEvaluate(items);
    if (args.prompt_logits) promptLogits ??= outputs.map((output) => byToken(output.next.logits));
    logits.push(byToken(outputs[last].next.logits));
    greedy.push(outputs[last].next.token);
    pending = [greedy.at(-1)];
}
const metadata = model.fileInfo.metadata;
process.stdout.write(JSON.stringify({
    prompt_tokens: Array.from(model.tokenize(args.prompt, true)),
    prompt_logits: promptLogits, greedy, greedy_logits: logits,
    runtime: {package: "node-llama-cpp", llama_cpp: llama.llamaCppRelease, build: llama.buildType},
    metadata: {"general.architecture": metadata.general.architecture,
               "tokenizer.chat_template": metadata.tokenizer.chat_template},
}));
await context.dispose();
await model.dispose();
await llama.dispose();
