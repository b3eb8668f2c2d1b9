// The AI SDK's pattern: tools together with Output.object (generateText), through the
// OpenAI-compatible provider. Usage: node ai_sdk.mjs BASE_URL MODEL. Exits non-zero on failure.
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { generateText, Output, stepCountIs, tool } from "ai";
import { z } from "zod";

const [baseURL, model] = process.argv.slice(2);
const provider = createOpenAICompatible({
  name: "veloxquant",
  baseURL: `${baseURL}/v1`,
  apiKey: "x",
  supportsStructuredOutputs: true,
});
// A random-weight model sampled at temperature 1 may call the tool at every step or never close
// its object within the tokens: a few seeds are tried, and one must end in the schema's object.
for (const seed of [2, 1, 6, 8]) {
  const calls = [];
  const result = await generateText({
    model: provider(model),
    tools: {
      weather: tool({
        description: "Weather in a city",
        inputSchema: z.object({ city: z.enum(["Paris", "Oslo"]) }),
        execute: async ({ city }) => {
          calls.push(city);
          return `sunny in ${city}`;
        },
      }),
    },
    experimental_output: Output.object({
      schema: z.object({
        kind: z.enum(["cat", "dog", "fish"]),
        legs: z.number().int().min(0).max(8),
      }),
    }),
    stopWhen: stepCountIs(8),
    maxOutputTokens: 120,
    temperature: 1,
    seed,
    prompt: "which pet suits Paris weather?",
  });
  let output;
  try {
    output = result.experimental_output;
  } catch (error) {
    const last = result.steps.at(-1);
    console.error(`seed ${seed}: no output (${result.steps.length} steps, last ${last?.finishReason})`);
    continue;
  }
  if (!["cat", "dog", "fish"].includes(output.kind) || !Number.isInteger(output.legs)
      || output.legs < 0 || output.legs > 8) {
    throw new Error(`not the schema: ${JSON.stringify(output)}`);
  }
  console.log(JSON.stringify({ output, calls, steps: result.steps.length, seed }));
  process.exit(0);
}
throw new Error("no seed ended in the output object");
