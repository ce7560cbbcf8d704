// Streaming chat with the Node client.
//   kvmux serve &                          (another terminal)
//   cd clients/typescript && npm ci && node examples/chat.mjs [ENDPOINT]
// ENDPOINT defaults to the local daemon (KVMUX_ENDPOINT or the runtime dir's
// ipc socket); pass tcp://host:port for a remote one.
import { Client, Overloaded, KvmuxError } from "kvmux";

const client = new Client(process.argv[2], { timeoutMs: 60_000 });
try {
  const session = await client.openSession({ system: "You are a concise assistant.", maxTokens: 48 });
  for (const question of ["What is the capital of France?", "And of Italy?"]) {
    console.log(`> ${question}`);
    const stream = session.chat(question);
    for await (const chunk of stream) process.stdout.write(chunk.text);
    const r = stream.result;
    console.log(`\n[${r.stopReason}: ${r.promptTokens} prompt tokens in ${r.prefillS.toFixed(2)}s, ${r.completionTokens} tokens in ${r.decodeS.toFixed(2)}s]`);
  }

  // Cancel with an AbortSignal (here: after half a second).
  const stream = session.chat("Count from one to fifty in words.", { signal: AbortSignal.timeout(500) });
  try {
    for await (const chunk of stream) process.stdout.write(chunk.text);
  } catch (err) {
    if (err.name !== "TimeoutError" && err.name !== "AbortError") throw err;
    console.log(" ... [aborted]");
  }

  // `break` cancels too, and waits until the worker has stopped.
  const again = session.chat("Name three colours.", { maxTokens: 16 });
  for await (const chunk of again) { process.stdout.write(chunk.text); break; }
  console.log(` ... [${again.result?.stopReason}]`);

  const info = await session.info();
  console.log(`history ${info.historyTokens} tokens, KV ${(info.kvLiveBytes / 1e6).toFixed(1)} MB live of ${(info.slabBytes / 1e6).toFixed(1)} MB`);
  await session.close();
  await session.info().catch((err) => console.log(`after close: ${err.name}: ${err.message}`));
} catch (err) {
  if (err instanceof Overloaded) console.error(`daemon full (${err.reason}); retry in ${err.retryAfterS ?? 1}s`);
  else if (err instanceof KvmuxError) console.error(`${err.name} (${err.code}): ${err.message}`);
  else throw err;
  process.exitCode = 1;
} finally {
  await client.close();
}
