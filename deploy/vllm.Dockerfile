# vLLM's OpenAI server with encode-server's EC connector (encode_client.vllm_connector), for the EPD
# path (docs/vllm.md). Built from the repository root:
#   docker build -f deploy/vllm.Dockerfile -t encode-server-vllm:0.1.0 .
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
COPY clients/python /tmp/encode-client
RUN pip install --no-cache-dir "/tmp/encode-client[vllm]" && rm -rf /tmp/encode-client
ENTRYPOINT ["vllm", "serve"]
