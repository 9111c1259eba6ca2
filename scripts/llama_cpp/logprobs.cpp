// rope-patch-logprobs: per-token log-probabilities from llama.cpp, with llama.cpp's own command-line parser.
//
//     rope-patch-logprobs TOKENS.i32 OUT.f32 -- -m MODEL.gguf [any llama.cpp option: --rope-scaling yarn ...]
//
// TOKENS.i32: the token ids (int32, native byte order). OUT.f32: log p(token i | tokens < i) for i = 1 .. N-1, as
// float32, computed in double from the float logits. The options after "--" go through common_params_parse exactly as
// they would for llama-cli or llama-server, so `rope-patch export --engine llama.cpp --print-args` flags are checked as
// a user would pass them (scripts/check_engines.py --engine llama.cpp-flags). Tokens are decoded in batches of
// --batch-size with every position's logits kept; both runs a check compares use the same batching.

#include "arg.h"
#include "common.h"
#include "llama.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

static void usage(int, char ** argv) {
    fprintf(stderr, "usage: %s TOKENS.i32 OUT.f32 -- -m MODEL.gguf [llama.cpp options]\n", argv[0]);
}

int main(int argc, char ** argv) {
    if (argc < 4 || std::strcmp(argv[3], "--") != 0) {
        usage(argc, argv);
        return 2;
    }
    const std::string tokens_path = argv[1], out_path = argv[2];

    std::ifstream in(tokens_path, std::ios::binary | std::ios::ate);
    if (!in) {
        fprintf(stderr, "rope-patch-logprobs: cannot read %s\n", tokens_path.c_str());
        return 2;
    }
    const std::streamsize bytes = in.tellg();
    in.seekg(0);
    std::vector<llama_token> tokens(bytes / sizeof(llama_token));
    in.read(reinterpret_cast<char *>(tokens.data()), bytes);
    if (tokens.size() < 2) {
        fprintf(stderr, "rope-patch-logprobs: %s holds fewer than 2 tokens\n", tokens_path.c_str());
        return 2;
    }

    // argv[3] = "--": llama.cpp's parser sees the program name and the options after it
    std::vector<char *> llama_argv = {argv[0]};
    for (int i = 4; i < argc; ++i) {
        llama_argv.push_back(argv[i]);
    }
    common_params params;
    common_init();
    if (!common_params_parse((int) llama_argv.size(), llama_argv.data(), params, LLAMA_EXAMPLE_PERPLEXITY, usage)) {
        return 2;
    }
    llama_backend_init();
    auto init = common_init_from_params(params);
    llama_model * model = init->model();
    llama_context * ctx = init->context();
    if (model == nullptr || ctx == nullptr) {
        fprintf(stderr, "rope-patch-logprobs: could not load %s\n", params.model.path.c_str());
        return 1;
    }
    const int n = (int) tokens.size();
    const int n_ctx = (int) llama_n_ctx(ctx);
    if (n > n_ctx) {
        fprintf(stderr, "rope-patch-logprobs: %d tokens exceed the context of %d (--ctx-size)\n", n, n_ctx);
        return 2;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const int n_batch = params.n_batch;

    std::vector<float> logprobs;  // [n - 1]
    logprobs.reserve(n - 1);
    common_batch batch(ctx);
    for (int start = 0; start < n; start += n_batch) {
        const int size = std::min(n - start, n_batch);
        batch.clear();
        for (int i = 0; i < size; ++i) {
            batch.add(tokens[start + i], start + i, 0, true);
        }
        if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch.get())) {
            fprintf(stderr, "rope-patch-logprobs: llama_process failed at token %d\n", start);
            return 1;
        }
        const float * logits = llama_get_logits(ctx);  // [size, n_vocab]
        for (int i = 0; i < size && start + i + 1 < n; ++i) {
            const float * row = logits + (size_t) i * n_vocab;
            double top = row[0];
            for (int v = 1; v < n_vocab; ++v) {
                top = std::max(top, (double) row[v]);
            }
            double sum = 0.0;
            for (int v = 0; v < n_vocab; ++v) {
                sum += std::exp((double) row[v] - top);
            }
            logprobs.push_back((float) ((double) row[tokens[start + i + 1]] - top - std::log(sum)));
        }
    }
    std::ofstream out(out_path, std::ios::binary);
    out.write(reinterpret_cast<const char *>(logprobs.data()), logprobs.size() * sizeof(float));
    if (!out) {
        fprintf(stderr, "rope-patch-logprobs: cannot write %s\n", out_path.c_str());
        return 1;
    }
    fprintf(stderr, "rope-patch-logprobs: %d log-probabilities written to %s\n", n - 1, out_path.c_str());
    return 0;
}
