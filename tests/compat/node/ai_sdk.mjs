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
    schema: z.object({ kind: z.enum(["cat", "dog", "fish"]), legs: z.number().int() }),
  }),
  stopWhen: stepCountIs(8),
  maxOutputTokens: 120,
  temperature: 1,
  seed: 2,
  prompt: "which pet suits Paris weather?",
});
const output = result.experimental_output;
if (!["cat", "dog", "fish"].includes(output.kind) || !Number.isInteger(output.legs)) {
  throw new Error(`not the schema: ${JSON.stringify(output)}`);
}
console.log(JSON.stringify({ output, calls, steps: result.steps.length }));
