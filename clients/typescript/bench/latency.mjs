// Latency of the Node client against a running daemon, for `kvmux bench clients`:
//   node bench/latency.mjs ENDPOINT [INFO_CALLS] [CHATS]
// Prints one JSON line: session-info round trips and time to first token of a
// short chat (fresh session each), in milliseconds.
import { Client } from "kvmux";

const [endpoint, infoCalls = "500", chats = "5"] = process.argv.slice(2);
const ms = (start) => Number(process.hrtime.bigint() - start) / 1e6;

const client = new Client(endpoint, { timeoutMs: 120_000 });
try {
  const session = await client.openSession();
  const info = [];
  for (let i = 0; i < 20; i++) await session.info(); // warm-up
  for (let i = 0; i < Number(infoCalls); i++) {
    const start = process.hrtime.bigint();
    await session.info();
    info.push(ms(start));
  }
  await session.close();
  const ttft = [];
  for (let i = 0; i < Number(chats); i++) {
    const chat = await client.openSession();
    const start = process.hrtime.bigint();
    const stream = chat.chat("Hi!", { maxTokens: 4 });
    for await (const _chunk of stream) {
      ttft.push(ms(start));
      break; // cancels the rest on the worker
    }
    await chat.close();
  }
  console.log(JSON.stringify({ client: "node", info_ms: info, ttft_ms: ttft }));
} finally {
  await client.close();
}
