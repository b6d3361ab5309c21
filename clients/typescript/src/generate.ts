// Streams one completion from a splitserve frontend and prints its text as it arrives.
//
//   node dist/generate.js "The quick brown fox" --max-tokens 32 --temperature 0
//
// Speaks plain gRPC over HTTP/2 (Connect's gRPC transport), so it talks to the Python frontend
// directly: no proxy. The address comes from --addr, else $SPLITSERVE_ADDR, else 127.0.0.1:50051.
import { parseArgs } from "node:util";

import { create } from "@bufbuild/protobuf";
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";

import { FinishReason, SamplingParamsSchema } from "./gen/splitserve/common/v1/types_pb.js";
import {
  GenerateRequestSchema,
  GenerationService,
} from "./gen/splitserve/frontend/v1/generation_service_pb.js";

const USAGE = `usage: generate PROMPT [--addr HOST:PORT] [--max-tokens N] [--temperature T]
                [--seed S] [--ignore-eos] [--timeout SECONDS] [--summary]`;

function parseFlags() {
  try {
    return parseFlagsOrThrow();
  } catch (err) {
    console.error(`${USAGE}\ngenerate: ${err instanceof Error ? err.message : err}`);
    process.exit(2);
  }
}

function parseFlagsOrThrow() {
  const { values, positionals } = parseArgs({
    allowPositionals: true,
    options: {
      addr: { type: "string", default: process.env.SPLITSERVE_ADDR ?? "127.0.0.1:50051" },
      "max-tokens": { type: "string", default: "64" },
      temperature: { type: "string" },
      seed: { type: "string" },
      "ignore-eos": { type: "boolean", default: false },
      timeout: { type: "string", default: "600" },
      // After the text, print {"token_ids": [...], "finish_reason": "..."} as one line to stderr.
      summary: { type: "boolean", default: false },
      help: { type: "boolean", default: false },
    },
  });
  if (values.help || positionals.length !== 1) {
    console.log(USAGE);
    process.exit(values.help ? 0 : 2);
  }
  return { prompt: positionals[0], ...values };
}

async function main(): Promise<number> {
  const flags = parseFlags();
  const transport = createGrpcTransport({ baseUrl: `http://${flags.addr}` });
  const client = createClient(GenerationService, transport);
  const request = create(GenerateRequestSchema, {
    input: { case: "prompt", value: flags.prompt },
    samplingParams: create(SamplingParamsSchema, {
      maxTokens: Number(flags["max-tokens"]),
      ignoreEos: flags["ignore-eos"],
      temperature: flags.temperature === undefined ? undefined : Number(flags.temperature),
      seed: flags.seed === undefined ? undefined : BigInt(flags.seed),
    }),
  });
  const tokenIds: number[] = [];
  let finishReason = FinishReason.UNSPECIFIED;
  try {
    const timeoutMs = Number(flags.timeout) * 1000;
    for await (const response of client.generate(request, { timeoutMs })) {
      process.stdout.write(response.text);
      tokenIds.push(...response.tokenIds);
      if (response.finishReason !== FinishReason.UNSPECIFIED) {
        finishReason = response.finishReason;
      }
    }
  } catch (err) {
    const error = ConnectError.from(err);
    console.error(`generate: ${Code[error.code]}: ${error.rawMessage}`);
    return 1;
  }
  process.stdout.write("\n");
  if (flags.summary) {
    console.error(JSON.stringify({ token_ids: tokenIds, finish_reason: FinishReason[finishReason] }));
  }
  return 0;
}

process.exitCode = await main();
